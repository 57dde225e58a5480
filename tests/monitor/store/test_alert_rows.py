"""The store's alert ledger on a real database: what the evaluator decides, written and read back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from qkwatch.monitor.alerting.evaluator import AlertLedger, StoredState, evaluate_batch
from qkwatch.monitor.alerting.rules import RuleSet
from qkwatch.monitor.store.alerts import AlertRows
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.wire import RunCreate


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
    assert (alert.starts_at, alert.ends_at) == (100.0, 200.0)
    pending = [n for n in store.claim_notifications(now=300.0) if n.alert.id == alert.id]
    assert [(n.status, n.attempts) for n in pending] == [("firing", 0), ("resolved", 0)]
