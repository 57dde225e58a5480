"""One lock order on PostgreSQL: a run's row before its other rows, in every write (issue 21, M3).

Each test holds a write of a run open in a transaction of its own (the real ingest or resume,
``ingest.write_batch`` or ``lifecycle.create_or_resume``, on a connection the test commits), starts
the competing write in a thread, waits until PostgreSQL shows it waiting for a lock (a wait on the
database's state, not on the clock), then finishes the first write. SQLite has one writer at a time
(``BEGIN IMMEDIATE``), so only PostgreSQL can interleave them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.runs import lifecycle
from qkwatch.monitor.store.store import NotFound, Store
from qkwatch.monitor.store.values import ingest
from qkwatch.rules.ruleset import RuleSet
from tests.conftest import missing_service
from tests.monitor.conftest import PG_ADMIN_URL, _fresh_database, _pg_admin

RULES = RuleSet.default()
T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def pg_db() -> Iterator[str]:
    """A PostgreSQL database of this module's own: the heartbeat and retention look at every run."""
    admin = _pg_admin()
    if admin is None:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    yield from _fresh_database(admin)


@pytest.fixture
def store(pg_db: str) -> Iterator[Store]:
    s = Store(make_engine(pg_db))
    try:
        yield s
    finally:
        s.close()


def batch(*steps: int) -> ReportBatch:
    """Reports that write points, frames, latest values, events, running entropies and a firing alert."""
    reports = [
        {
            "step": s,
            "time": float(s),
            "layers": {"qkai": [0.95, 0.2], "attn_entropy": [0.9, 0.8]},
            "scalars": {"loss": 2.0},
            "events": [{"kind": "note", "message": f"step {s}"}],
        }
        for s in steps
    ]
    return ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports})


def new_run(store: Store) -> tuple[m.RunRow, str]:
    project = f"locks-{uuid.uuid4().hex[:8]}"
    run, _ = store.create_or_resume_run(RunCreate(project=project, name="r", attempt_key="k1"), now=T0)
    store.add_reports(run.id, batch(1, 2, 3), RULES, now=T0)
    return run, project


def write_in(conn: sa.Connection, store: Store, run_id: str, b: ReportBatch, now: float) -> None:
    """The body of ``Store.add_reports`` in the caller's transaction."""
    ingest.write_batch(conn, run_id, b, ingest.flatten(b), RULES, now)


class Competitor:
    """``call()`` in a thread; its result or its exception."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = call()
            except BaseException as exc:  # handed to the test, which asserts on it
                self.error = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the competing write never finished"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until_blocked(store: Store) -> None:
    """Until a session of this database waits for a lock (the competitor met the open write's lock)."""
    deadline = time.monotonic() + 60  # a guard against a hang, not a timing: it returns at the first sight
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    while time.monotonic() < deadline:
        with store.engine.connect() as conn:
            if conn.execute(query).scalar():
                return
        time.sleep(0.005)
    raise AssertionError("the competing write never waited for a lock")


def rows_left(store: Store, pk: int) -> dict[str, int]:
    with store.engine.connect() as conn:
        left = {
            t.name: conn.execute(sa.select(sa.func.count()).select_from(t).where(t.c.run_pk == pk)).scalar()
            for t in m.metadata.sorted_tables
            if "run_pk" in t.c
        }
        left["runs"] = conn.execute(sa.select(sa.func.count()).select_from(m.runs).where(m.runs.c.pk == pk)).scalar()
    return {table: n for table, n in left.items() if n}


def test_a_delete_waits_for_a_batch_in_flight_and_leaves_nothing(store: Store) -> None:
    """The red team's deadlock: the delete took the run's rows before the run, ingest the run first.

    The open batch stores new steps, then the same steps again (stored points to check: they were
    the delete's to lock under the old order), and commits; the delete then removes all of it.
    """
    run, _ = new_run(store)
    with store.engine.connect() as writer:
        with writer.begin():
            write_in(writer, store, run.id, batch(4, 5), T0 + 1)
            delete = Competitor(lambda: store.delete_run(run.id))
            wait_until_blocked(store)
            write_in(writer, store, run.id, batch(1, 2, 3, 4, 5), T0 + 2)
        delete.join()
    assert rows_left(store, run.pk) == {}
    with pytest.raises(NotFound, match=f"run {run.id} not found"):  # the API's 404
        store.add_reports(run.id, batch(6), RULES, now=T0 + 3)


def test_a_batch_that_waited_for_a_delete_finds_no_run(store: Store) -> None:
    """The other way round: the batch waits for the run, and gets the API's 404 (the contract for a deleted run)."""
    run, _ = new_run(store)
    with store.engine.connect() as deleter:
        with deleter.begin():
            lifecycle.delete(deleter, run.pk)
            late = Competitor(lambda: store.add_reports(run.id, batch(4), RULES, now=T0 + 1))
            wait_until_blocked(store)
        with pytest.raises(NotFound, match=f"run {run.id} not found"):
            late.join()
    assert rows_left(store, run.pk) == {}


def test_the_heartbeat_does_not_mark_a_run_whose_report_is_being_stored(store: Store) -> None:
    run, _ = new_run(store)  # last report at T0: stale at T0 + 1000 with a 900 s timeout
    with store.engine.connect() as writer:
        with writer.begin():
            write_in(writer, store, run.id, batch(4), T0 + 1000)
            heartbeat = Competitor(lambda: store.mark_stale(900, now=T0 + 1000))
            wait_until_blocked(store)
        assert heartbeat.join() == []
    after = store.get_run(run.id)
    assert (after.status, after.status_reason, after.last_step) == ("running", None, 4)
    assert [a.state for a in store.list_alerts(projects=[run.project], run_id=run.id)] == ["firing"]


def test_retention_keeps_a_run_resumed_while_it_looked(store: Store) -> None:
    run, project = new_run(store)
    store.set_status(run.id, "finished", now=T0)
    later = T0 + 2 * 86400
    with store.engine.connect() as resumer:
        with resumer.begin():
            lifecycle.create_or_resume(resumer, RunCreate(project=project, name="r", attempt_key="k2"), later)
            retention = Competitor(lambda: store.apply_retention(1, now=later))
            wait_until_blocked(store)
        assert retention.join() == []
    after = store.get_run(run.id)
    assert (after.status, after.latest_attempt) == ("running", 2)
    store.add_reports(run.id, batch(4), RULES, now=later)  # the resumed run still takes its reports
    assert store.series(after, "loss", -1).steps == [1, 2, 3, 4]
