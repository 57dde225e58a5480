"""The run scalars are read through their partial index (migration 0012), not by scanning a metric's layer values.

Under the points' key (run, metric id, head, step, layer, attempt) a metric's scalars lie one per
step among its layer values. Every read of scalars must be a range of ``ix_points_run_scalars``:
checked on the statements the store really sends (caught at the cursor), by each database's own
planner, on a run whose layer values far outnumber its scalars. And the index changes no answer.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import is_postgres, make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet
from tests.monitor.store.plans import plan_of, statements

LAYERS, STEPS = 24, 400


def _fill(store: Store, attempts: int) -> m.RunRow:
    """A run with ``qkai`` at every layer and step, and ``loss`` and ``qkai`` as scalars every 10th step."""
    project = f"scalars-{uuid.uuid4().hex[:8]}"
    for attempt in range(1, attempts + 1):
        run, _ = store.create_or_resume_run(RunCreate(project=project, name="r", attempt_key=f"a{attempt}"))
        for lo in range(0, STEPS, 50):
            reports = [
                {
                    "step": s,
                    "time": 1.0,
                    "layers": {"qkai": [(s + la) / 1000 for la in range(LAYERS)]},
                    "scalars": {"loss": 10 - s / 100 + attempt, "qkai": s / 10} if s % 10 == 0 else {},
                }
                for s in range(lo, lo + 50)
            ]
            batch = ReportBatch.model_validate({"batch_id": uuid.uuid4(), "attempt": attempt, "reports": reports})
            store.add_reports(run.id, batch, RuleSet.default())
    return store.get_run(run.id)


def _reads_scalars(statement: str) -> bool:
    """A statement on ``points`` with the run scalars' condition (``models.RUN_SCALARS``) in it."""
    return "points" in statement and "layer = -1" in statement.replace("points.", "")


def _analyze(engine: sa.Engine) -> None:
    """Statistics for PostgreSQL's planner (SQLite's plans here need none)."""
    if is_postgres(engine):
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE points")


@pytest.mark.parametrize("attempts", [1, 2])
def test_every_read_of_the_scalars_uses_their_index(db_url: str, attempts: int):
    engine = make_engine(db_url)
    store = Store(engine)
    try:
        run = _fill(store, attempts)
        _analyze(engine)
        reads = {
            "history": lambda: store.history(run, ["qkai", "loss"], max_points=10**6),
            "history_doubles": lambda: _history_doubles(store, run),
            "series of a scalar": lambda: store.series(run, "loss", -1),
            "series of a scalar, bucketed": lambda: store.series(run, "loss", -1, max_points=5),
        }
        for name, read in reads.items():
            _, sent = statements(engine, _reads_scalars, read)
            assert sent, f"{name}: no statement read the scalars"
            for statement, parameters in sent:
                plan = plan_of(engine, statement, parameters)
                assert "ix_points_run_scalars" in plan, f"{name}: {statement}\n{plan}"
    finally:
        store.close()


def test_the_index_changes_no_answer(db_url: str):
    """The scalars read through the index are the ones stored: every 10th step, the latest attempt's."""
    store = Store(make_engine(db_url))
    try:
        run = _fill(store, 2)
        grids = store.history(run, ["qkai", "loss"])
        loss = grids["loss"]
        assert loss.layers == [m.RUN_SCALAR]
        assert loss.steps == list(range(0, STEPS, 10))
        assert [row[0] for row in loss.values] == [10 - s / 100 + 2 for s in loss.steps]
        qkai = grids["qkai"]  # a metric with both: its scalar is layer -1 beside the layer values
        assert qkai.layers == [m.RUN_SCALAR, *range(LAYERS)]
        assert [row[0] for row in qkai.values] == [s / 10 if s % 10 == 0 else None for s in range(STEPS)]
        assert [row[1] for row in qkai.values] == [s / 1000 for s in range(STEPS)]
        series = store.series(run, "loss", -1)
        assert series.steps == loss.steps and list(series.values) == [row[0] for row in loss.values]
    finally:
        store.close()


def _history_doubles(store, run):
    with store.snapshot() as snap:
        return snap.history_doubles(run, ["qkai", "loss"], max_points=10**6)
