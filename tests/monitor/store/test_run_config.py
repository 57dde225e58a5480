"""The run config the store hands out: typed once when a row is read, stored rows of older databases included."""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.contract.wire import ReportBatch, RunConfig, RunCreate
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    store = Store(make_engine(db_url))
    yield store
    store.close()


def create(store: Store, config: dict[str, Any]) -> m.RunRow:
    body = RunCreate(project=f"proj-{uuid.uuid4().hex[:10]}", name="r", config=config)
    return store.create_or_resume_run(body)[0]


def store_text(store: Store, run: m.RunRow, text: str | None = None) -> str:
    """The config column as stored; with ``text``, overwrite it first (a row an older collector wrote)."""
    with store.engine.begin() as conn:
        if text is not None:
            conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk).values(config=text))
        return conn.execute(sa.select(m.runs.c.config).where(m.runs.c.pk == run.pk)).scalar_one()


def test_a_row_carries_the_typed_config_and_the_column_its_json(store: Store) -> None:
    run = create(store, {"schedule": {"beta": 0.1}, "n_layers": 3, "lr": 1e-3})
    row = store.get_run(run.id)
    assert isinstance(row.config, RunConfig) and row.config.schedule == ScheduleConfig(beta=0.1)
    assert row.config.n_layers == 3 and row.config.model_extra == {"lr": 1e-3}
    schedule = dataclasses.asdict(ScheduleConfig(beta=0.1))
    assert json.loads(store_text(store, run)) == {"schedule": schedule, "n_layers": 3, "lr": 1e-3}


LEGACY = [
    # (stored by an older collector, the schedule it loads with, its layer count, the keys set aside)
    ({"schedule": {"beta": 0}, "lr": 0.1}, ScheduleConfig(), None, ["schedule"]),
    ({"schedule": "fast", "n_layers": 3}, ScheduleConfig(), 3, ["schedule"]),
    ({"schedule": {"gamma": 1, "beta": 0.2}}, ScheduleConfig(), None, ["schedule"]),
    ({"schedule": {"ema": True}, "n_layers": 3_000_000}, ScheduleConfig(), None, ["schedule", "n_layers"]),
    ({"schedule": {"lambda_0": 10**400}}, ScheduleConfig(), None, ["schedule"]),
    ({"n_layers": 0, "lr": 0.1}, ScheduleConfig(), None, ["n_layers"]),
    ({"n_layers": "12"}, ScheduleConfig(), None, ["n_layers"]),
    ({"schedule": {"lambda_0": 1}, "n_layers": 2}, ScheduleConfig(lambda_0=1.0), 2, []),  # valid, never expanded
]


@pytest.mark.parametrize(("stored", "schedule", "n_layers", "set_aside"), LEGACY)
def test_a_config_stored_before_validation_loads_with_the_bad_keys_set_aside(
    store: Store,
    caplog: pytest.LogCaptureFixture,
    stored: dict[str, Any],
    schedule: ScheduleConfig,
    n_layers: int | None,
    set_aside: list[str],
) -> None:
    run = create(store, {"n_layers": 2})
    text = store_text(store, run, json.dumps(stored))
    with caplog.at_level(logging.WARNING, logger="qkwatch.monitor.store.runs.lookup"):
        row = store.get_run(run.id)
        again = store.get_run_by_name(run.project, run.name)
    assert row.config == again.config
    assert row.config.schedule == schedule and row.config.n_layers == n_layers
    assert row.config.model_extra == {k: v for k, v in stored.items() if k not in ("schedule", "n_layers")}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(set_aside)  # once per run and key, however often the row is read
    assert all(
        f"run {run.id}: its stored config.{key} is set aside" in w for key, w in zip(set_aside, warned, strict=True)
    )
    assert store_text(store, run) == text  # reading never rewrites what is stored


def test_a_stored_config_the_api_now_refuses_still_feeds_the_schedule(store: Store) -> None:
    run = create(store, {"n_layers": 2})
    store_text(store, run, json.dumps({"schedule": {"beta": -1}, "n_layers": 2}))
    batch = ReportBatch.model_validate(
        {"batch_id": str(uuid.uuid4()), "reports": [{"step": 1, "time": 1.0, "layers": {"attn_entropy": [0.9, 0.5]}}]}
    )
    store.add_reports(run.id, batch, RuleSet.default())
    row, state = store.lambda_state(run.id)
    assert row.config.schedule == ScheduleConfig() and state.n_layers == 2 and state.h == {0: 0.9, 1: 0.5}
    row, state = store.set_overrides(run.id, {0: ScheduleConfig().lambda_max}, who="test")
    assert state.overrides == {0: ScheduleConfig().lambda_max}


def test_a_resume_replaces_a_config_set_aside_and_may_set_the_layer_count(store: Store) -> None:
    run = create(store, {"n_layers": 2})
    store_text(store, run, json.dumps({"schedule": {"beta": 0}, "n_layers": 3_000_000}))
    body = RunCreate(project=run.project, name=run.name, config={"schedule": {"beta": 0.2}, "n_layers": 5})
    resumed, _ = store.create_or_resume_run(body)
    assert resumed.config.schedule == ScheduleConfig(beta=0.2) and resumed.config.n_layers == 5
    assert json.loads(store_text(store, run))["n_layers"] == 5
