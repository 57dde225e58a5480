"""The agent's run config: parsed by the collector's own parser, so its local schedule is the collector's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qkwatch import agent
from qkwatch.contract.scheduling import ScheduleConfig
from tests.agent.tiny import TinyGPT


def test_the_local_schedule_is_the_typed_schedule_of_the_run_config(tmp_path: Path) -> None:
    config = {"schedule": {"lambda_0": 1e-3, "beta": 0.1}, "lr": 3e-4}
    with agent.attach(TinyGPT(), url=None, project="tests", run="typed", spool=str(tmp_path), config=config) as a:
        assert a.lambdas_state.schedule == ScheduleConfig(lambda_0=1e-3, beta=0.1)
        sent = a.identity.config  # what the collector is sent: the given keys, and the schedule in full
        assert sent == {**config, "n_layers": 4, "schedule": dataclasses.asdict(a.lambdas_state.schedule)}
        assert set(sent["schedule"]) == {"lambda_0", "h_star", "beta", "ema", "lambda_max", "floor"}


def test_the_schedule_sent_carries_the_agents_default_h_star(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer started with QKWATCH_H_STAR schedules at it, and tells the collector so: the two
    sides cannot fall back to different defaults."""
    monkeypatch.setenv("QKWATCH_H_STAR", "0.8")
    with agent.attach(TinyGPT(), url=None, project="tests", run="h", spool=str(tmp_path)) as a:
        assert a.lambdas_state.schedule.h_star == 0.8
        assert a.identity.config["schedule"]["h_star"] == 0.8


@pytest.mark.parametrize(
    ("schedule", "named"), [({"beta": 0}, "config.schedule.beta"), ({"ema": True}, "config.schedule.ema")]
)
def test_a_bad_schedule_fails_attach_naming_the_field(tmp_path: Path, schedule: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        agent.attach(
            TinyGPT(), url=None, project="tests", run="bad", spool=str(tmp_path), config={"schedule": schedule}
        )
