"""The fleet, small: two ``qkwatch serve --workers 2`` replicas behind HAProxy over one PostgreSQL.

Eight simulated agent ranks (two runs of 48 layers, four ranks each, the agent's own spool, sender
and transport) report for 30 s at a compressed cadence while one replica is killed with SIGKILL
(supervisor and workers) and restarted. The figures of the full bench are in bench/RESULTS.md;
this test holds only what must be true at any speed: every point sent is stored exactly once,
every alert is raised once per (run, rule, layer), every replica serves the same lambdas (the EMA
of the entropies sent), and the balancer routes around the dead replica and back to it.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import sqlalchemy as sa

from bench.fleet.checks import problems
from bench.fleet.config import HAPROXY, PG_ADMIN_URL, FleetConfig
from bench.fleet.session import run_fleet
from bench.fleet.values import expected_alerts
from tests.conftest import missing_service

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if shutil.which(HAPROXY) is None:
        missing_service(f"HAProxy ({HAPROXY}; apt-get install haproxy)")
    try:  # the server answers (the fleet makes its own database on it)
        engine = sa.create_engine(PG_ADMIN_URL)
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        engine.dispose()
    except sa.exc.OperationalError:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    cfg = FleetConfig(
        replicas=2,
        workers=2,
        ranks=8,
        ranks_per_run=4,
        duration=30.0,
        kill_at=0.2,  # early, so that the restarted replica serves again before the end
        down_seconds=3.0,
        agent_procs=1,
        sample_seconds=0.1,  # read the lambdas from both replicas often: a torn read shows as a split version
    )
    return run_fleet(cfg, tmp_path_factory.mktemp("fleet"), log=lambda *_: None)


def test_every_point_sent_is_stored_exactly_once(fleet: dict[str, Any]) -> None:
    points = fleet["points"]
    assert points["sent"] > 0
    assert (points["stored"], points["lost"], points["duplicated"]) == (points["sent"], 0, 0)
    assert points["runs_whose_value_sums_differ"] == []
    assert points["frames_stored"] == points["frames_sent"]
    assert (points["pending_bytes_left"], points["dead_lettered"]) == (0, 0)


def test_each_alert_is_raised_once_whichever_replica_judged_the_reports(fleet: dict[str, Any]) -> None:
    alerts = fleet["alerts"]
    assert alerts["expected"] == len(expected_alerts(["run-000", "run-001"])) == 8
    assert (alerts["missing"], alerts["unexpected"], alerts["more_than_once"]) == ([], [], [])
    assert alerts["notifications_firing_per_alert"] == [1]
    assert alerts["states"] == {"ended": 8}  # rank 0 finished each run while they fired
    assert alerts["rest_equal_on_every_replica"] and alerts["rest_count"] == [8, 8]


def test_every_replica_serves_the_same_lambdas_the_ema_of_what_was_sent(fleet: dict[str, Any]) -> None:
    lambdas = fleet["lambdas"]
    assert lambdas["runs_whose_replicas_differ"] == []
    assert lambdas["runs_not_the_ema_of_what_was_sent"] == []
    assert lambdas["versions_observed"] > 1  # the agents and the sampler saw the lambdas move
    assert lambdas["versions_with_two_answers"] == []


def test_a_replica_killed_with_sigkill_is_routed_around_and_back(fleet: dict[str, Any]) -> None:
    kill = fleet["kill"]
    assert kill["seen_down_at"] is not None, "HAProxy's health check never saw the killed replica down"
    assert kill["haproxy_chkdown"][kill["replica"]] >= 1
    assert kill["probe_after_the_load"][kill["replica"]] > 0, "the restarted replica is not in the rotation"
    assert fleet["statuses"] == {"finished": 2}


def test_the_session_has_no_problem_at_all(fleet: dict[str, Any]) -> None:
    assert problems(fleet) == []
