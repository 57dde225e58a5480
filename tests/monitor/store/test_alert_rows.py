"""The store's alert ledger on a real database: what the evaluator decides, written and read back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.runs.alerts import AlertRows
from qkwatch.monitor.store.store import Store
from qkwatch.rules.evaluator import AlertLedger, StoredState, evaluate_batch
from qkwatch.rules.kinds import BandRule, ForecastRule, GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet


@pytest.fixture
def store(isolated_db_url: str) -> Iterator[Store]:
    """A database of its own: claiming notifications sees every run's."""
    store = Store(make_engine(isolated_db_url))
    yield store
    store.close()


def evaluate(store: Store, run_pk: int, now: float, steps: range, qkai: float) -> int:
    """One ingest transaction's worth of alert evaluation: ``qkai`` on layer 0 at each step."""
    with store.engine.connect().execution_options(write=True) as conn, conn.begin():
        ledger: AlertLedger = AlertRows(conn, run_pk, now)
        return evaluate_batch(RuleSet.default(), ledger, 1, [(s, {"qkai": [qkai]}) for s in steps])


def test_an_alert_fires_and_resolves_across_transactions(store: Store) -> None:
    project = f"ledger-{uuid.uuid4().hex[:8]}"
    run, _ = store.create_or_resume_run(RunCreate(project=project, name="r"), now=50.0)
    assert evaluate(store, run.pk, 100.0, range(3), 0.9) == 1
    [alert] = store.list_alerts(projects=[project], run_id=run.id)
    with store.engine.connect() as conn:
        states = AlertRows(conn, run.pk, 0.0).load_states()
    assert states[("qkai_high", 0)] == StoredState(3, 0, 1, 2, (), alert.id)
    assert states[("collapse_band", -1)] == StoredState(0, None, 1, 2, (), None)

    assert evaluate(store, run.pk, 200.0, range(3, 4), 0.1) == 1
    [alert] = store.list_alerts(projects=[project], run_id=run.id)
    assert (alert.state, alert.layers, alert.onset_step, alert.resolved_step) == ("resolved", [0], 0, 3)
    assert (alert.starts_at_s, alert.ends_at_s) == (100.0, 200.0)  # epoch seconds, exactly
    pending = [n for n in store.claim_notifications(now=300.0) if n.alert.id == alert.id]
    assert [(n.status, n.attempts) for n in pending] == [("firing", 0), ("resolved", 0)]


DETECTORS = RuleSet(
    thresholds=(ThresholdRule("qkai_high", threshold=0.7, for_reports=2),),
    bands=(BandRule("collapse_band", band_of="qkai_high", min_layers=2),),
    growths=(GrowthRule("logit_growth", factor=2.0, baseline_reports=3, skip_reports=1, for_reports=2),),
    forecasts=(ForecastRule("qkai_forecast", horizon_steps=100, window=4),),
)


def detector_reports() -> list[dict]:
    """Layers 1 and 2: QKAI rising 0.004 per step from 0.5 (above 0.70 after step 50), then back to 0.4
    from step 120; layer 2's largest logit doubling by step 100. Layer 0 stays quiet. Steps 0-190 by 10."""
    out = []
    for step in range(0, 200, 10):
        rise = 0.5 + 0.004 * step if step < 120 else 0.4
        out.append(
            {
                "step": step,
                "time": float(step),
                "layers": {"qkai": [0.3, rise, rise], "logit_max": [6.0, 6.0, 6.0 * (1 + 0.01 * step)]},
            }
        )
    return out


def ingest(store: Store, run_id: str, reports: list[dict], batch_id: str | None = None) -> None:
    batch = ReportBatch.model_validate({"batch_id": batch_id or str(uuid.uuid4()), "reports": reports})
    store.add_reports(run_id, batch, DETECTORS, now=1000.0)


def alerts_of(store: Store, project: str, run_id: str) -> list[tuple]:
    rows = sorted(store.list_alerts(projects=[project], run_id=run_id), key=lambda a: a.id)
    return [(a.rule, a.state, a.layers, a.onset_step, a.resolved_step, a.summary, a.predicted_step) for a in rows]


def states_of(store: Store, run_pk: int) -> dict:
    with store.engine.connect() as conn:
        return {
            k: (s.streak, s.since_step, s.step, s.band_layers, s.alert_id is None, s.memory)
            for k, s in AlertRows(conn, run_pk, 0.0).load_states().items()
        }


@pytest.mark.parametrize("size", [1, 3, 7])
def test_detectors_in_batches_give_what_one_batch_gives_and_replays_change_nothing(store: Store, size: int) -> None:
    """The state of every kind (growth baselines and forecast windows included) survives the database
    between batches: the run cut into batches of ``size`` raises the same alerts as the run in one."""
    project = f"detect-{uuid.uuid4().hex[:8]}"
    whole, _ = store.create_or_resume_run(RunCreate(project=project, name="whole"))
    cut, _ = store.create_or_resume_run(RunCreate(project=project, name="cut"))
    reports = detector_reports()
    ingest(store, whole.id, reports)
    batch_ids = [str(uuid.uuid4()) for _ in range(0, len(reports), size)]
    for batch_id, lo in zip(batch_ids, range(0, len(reports), size), strict=True):
        ingest(store, cut.id, reports[lo : lo + size], batch_id)

    expected = alerts_of(store, project, whole.id)
    assert alerts_of(store, project, cut.id) == expected
    assert states_of(store, cut.pk) == states_of(store, whole.pk)
    assert [
        (rule, state, layers, onset, resolved, predicted)
        for rule, state, layers, onset, resolved, _, predicted in expected
    ] == [
        ("qkai_forecast", "resolved", [1], 30, 60, 50),  # 4 points at step 30: the crossing (50) 20 steps ahead
        ("qkai_forecast", "resolved", [2], 30, 60, 50),  # resolved: past 0.70 at 60, the threshold rule's turn
        ("qkai_high", "resolved", [1], 60, 120, None),
        ("qkai_high", "resolved", [2], 60, 120, None),
        ("collapse_band", "resolved", [1, 2], 70, 120, None),
        ("logit_growth", "firing", [2], 140, None, None),  # baseline mean(6.6, 7.2, 7.8) = 7.2: 2x from step 140
    ]
    assert expected[0][5] == "layer 1: qkai crossed 0.70: 0.74 at step 60 (forecast: step ~50)"
    assert (
        expected[-1][5] == "layer 2: logit_max 2.1x its early value (15 vs 7.2; fires at 2x for 2 consecutive reports)"
    )
    assert states_of(store, cut.pk)[("logit_growth", 2)][-1] == {
        "skipped": 1,
        "early": [6.0 * (1 + 0.01 * s) for s in (10, 20, 30)],
    }  # exact: JSON keeps every bit

    before = (alerts_of(store, project, cut.id), states_of(store, cut.pk))
    ingest(store, cut.id, reports[:5], batch_ids[0])  # the same batch id: a replay
    ingest(store, cut.id, reports)  # the same points again in a new batch
    ingest(store, cut.id, reports[3:9])  # a late batch
    assert (alerts_of(store, project, cut.id), states_of(store, cut.pk)) == before


THRESHOLD_ONLY = RuleSet(thresholds=(ThresholdRule("qkai_high", threshold=0.7),), bands=())


def rank_report(store: Store, run_id: str, layer: int, steps: range, qkai: float = 0.9) -> None:
    """One rank's batch: ``qkai`` on its own ``layer`` of 3 (the others not measured), at each step."""
    reports = [
        {"step": s, "time": float(s), "layers": {"qkai": [qkai if i == layer else None for i in range(3)]}}
        for s in steps
    ]
    store.add_reports(
        run_id, ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports}), THRESHOLD_ONLY
    )


def notifications_of(store: Store, project: str, run_id: str) -> dict[int, list[str]]:
    """Each alert's layer -> the statuses of the notifications queued for it, oldest first."""
    layer_of = {a.id: a.layers[0] for a in store.list_alerts(projects=[project], run_id=run_id)}
    out: dict[int, list[str]] = {layer: [] for layer in layer_of.values()}
    for n in store.claim_notifications(now=1e12, limit=1000):
        if n.alert.id in layer_of:
            out[layer_of[n.alert.id]].append(n.status)
    return out


def test_a_late_report_of_another_rank_does_not_reopen_what_the_runs_end_ended(store: Store) -> None:
    """Found by the fleet bench (bench/fleet.py): rank 0 marks the run finished while another rank's
    last report is still on its way; that report re-opened the ended alert as firing, on a finished
    run that nothing would end again, and sent a second firing notification."""
    project = f"late-{uuid.uuid4().hex[:8]}"
    body = {"project": project, "name": "r", "config": {"n_layers": 3}, "attempt_key": "launch-1"}
    run, _ = store.create_or_resume_run(RunCreate.model_validate(body))
    rank_report(store, run.id, 0, range(4))  # rank 0: layer 0 fires at step 2
    rank_report(store, run.id, 1, range(3))  # rank 1: layer 1 fires at step 2; its step 3 is late
    rank_report(store, run.id, 2, range(1))  # rank 2: far behind, layer 2 not firing yet
    store.set_status(run.id, "finished", attempt=1)  # rank 0's close: the run ended while 0 and 1 fired

    rank_report(store, run.id, 1, range(3, 4))  # rank 1's last report, delivered after the end
    rank_report(store, run.id, 2, range(1, 4))  # rank 2's, which make layer 2 fire

    alerts = {a.layers[0]: a for a in store.list_alerts(projects=[project], run_id=run.id)}
    assert {layer: (a.state, a.run_end, a.ended_step) for layer, a in alerts.items()} == {
        0: ("ended", "finished", 3),
        1: ("ended", "finished", 3),  # not re-opened: the run did not resume
        2: ("ended", "finished", 3),  # it fired after the end: the run ended while it fired
    }
    assert store.get_run(run.id).status == "finished"
    assert notifications_of(store, project, run.id) == {0: ["firing", "ended"], 1: ["firing", "ended"], 2: ["ended"]}

    # A resume still carries on where the run stopped: the same alerts fire again.
    store.create_or_resume_run(RunCreate.model_validate({**body, "attempt_key": "launch-2"}))
    for layer in range(3):
        rank_report(store, run.id, layer, range(4, 5))
    assert {a.layers[0]: a.state for a in store.list_alerts(projects=[project], run_id=run.id)} == {
        0: "firing",
        1: "firing",
        2: "firing",
    }
    assert notifications_of(store, project, run.id) == {0: ["firing"], 1: ["firing"], 2: ["firing"]}
