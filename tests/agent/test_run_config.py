"""The agent's run config: parsed by the collector's own parser, so its local schedule is the collector's."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkwatch import agent
from qkwatch.monitor.scheduling import ScheduleConfig
from tests.agent.tiny import TinyGPT


def test_the_local_schedule_is_the_typed_schedule_of_the_run_config(tmp_path: Path) -> None:
    config = {"schedule": {"lambda_0": 1e-3, "beta": 0.1}, "lr": 3e-4}
    with agent.attach(TinyGPT(), url=None, project="tests", run="typed", spool=str(tmp_path), config=config) as a:
        assert a.lambdas_state.schedule == ScheduleConfig(lambda_0=1e-3, beta=0.1)
        assert a.identity.config == {**config, "n_layers": 4}  # what the collector is sent: as given


@pytest.mark.parametrize(
    ("schedule", "named"), [({"beta": 0}, "config.schedule.beta"), ({"ema": True}, "config.schedule.ema")]
)
def test_a_bad_schedule_fails_attach_naming_the_field(tmp_path: Path, schedule: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        agent.attach(
            TinyGPT(), url=None, project="tests", run="bad", spool=str(tmp_path), config={"schedule": schedule}
        )
