"""Metric names: a run's names are bounded, names no run uses are reclaimed, and an ingest and a reclaim
never leave a point under a deleted or wrong id (issue 21, L5 and H1), on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import metric_names
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.errors import Invalid
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.store.values import ingest
from qkwatch.rules.ruleset import RuleSet
from tests.monitor.conftest import report

LOCK_WAIT_S = 60
"""A deadline for a condition that must come true (a backend waiting on a lock), not a timing."""


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    """A database of its own: these tests count every name in it."""
    return isolated_db_url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(make_engine(db_url))
    yield s
    s.close()


def batch(*reports: dict) -> ReportBatch:
    return ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": list(reports)})


def names_in(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return set(conn.execute(sa.select(m.metric_names.c.name)).scalars())


def new_run(store: Store, name: str = "r") -> m.RunRow:
    run, _ = store.create_or_resume_run(RunCreate(project="names", name=name))
    return run


def test_names_of_a_deleted_run_are_reclaimed_and_shared_ones_kept(h):
    """L5's reproduction, small: a run's many scalar names outlived it. Now deleting the run deletes the
    names no other run uses; a name another run uses stays, with its values."""
    with h.store.engine.connect() as conn:
        before = set(conn.execute(sa.select(m.metric_names.c.name)).scalars())
    keep = h.create_run()["id"]
    h.send(keep, [report(0, {"qkai": [0.5, 0.6]}, scalars={"loss": 2.0})])
    gone = h.create_run()["id"]
    many = {f"noise_{i}": float(i) for i in range(300)}
    h.send(gone, [report(0, {"qkai": [0.1, 0.2]}, scalars={"loss": 3.0, **many})])
    assert h.client.delete(f"/v1/runs/{gone}", headers=h.headers("control")).status_code == 204
    with h.store.engine.connect() as conn:
        after = set(conn.execute(sa.select(m.metric_names.c.name)).scalars())
    assert after - before == {"qkai", "loss"}
    assert h.get(f"/v1/runs/{keep}/series", metric="qkai", layer=1)["values"] == [0.6]
    assert h.get(f"/v1/runs/{keep}/series", metric="loss")["values"] == [2.0]


def test_retention_and_maintenance_reclaim_names(make_harness):
    """The maintenance pass: names of runs its retention deletes go at once, and a name no run uses for
    another reason (left by an earlier collector) goes too; a name reclaimed can be used again."""
    h = make_harness(retention_days=1)
    store, maintenance = h.store, h.app.state.background
    old = new_run(store, "old")
    store.add_reports(old.id, batch(report(0, scalars={"old_only": 1.0})), RuleSet.default())
    store.set_status(old.id, "finished", now=0.0)
    with store.engine.begin() as conn:
        conn.execute(sa.insert(m.metric_names).values(name="left_behind"))
    assert names_in(store) == {"old_only", "left_behind"}
    maintenance.run_once(now=10 * 86400)
    assert names_in(store) == set()
    with store.engine.begin() as conn:
        conn.execute(sa.insert(m.metric_names).values(name="left_behind"))
    maintenance.run_once(now=10 * 86400)
    assert names_in(store) == set()
    run = new_run(store, "again")
    store.add_reports(run.id, batch(report(3, scalars={"old_only": 7.0})), RuleSet.default())
    assert store.series(run, "old_only", m.RUN_SCALAR).values == [7.0]


def test_a_run_may_not_pass_its_name_limit(store: Store):
    """Over the limit the batch is refused whole (no point, no name, no batch id stored), naming the limit
    and its value; names the run has already do not count again, and each run has its own."""
    rules = RuleSet.default()
    run = new_run(store)
    store.add_reports(run.id, batch(report(0, {"qkai": [0.5]}, scalars={"loss": 2.0})), rules, max_metric_names=3)
    refused = batch(report(1, {"qkai": [0.6]}, scalars={"loss": 1.9, "lr": 1e-3, "grad_norm": 0.2}))
    with pytest.raises(Invalid) as err:
        store.add_reports(run.id, refused, rules, max_metric_names=3)
    message = str(err.value)
    for part in (
        "names/r",
        "2 distinct metric names",
        "adds 2 (grad_norm, lr)",
        "the limit is 3",
        "max_metric_names_per_run",
    ):
        assert part in message
    assert names_in(store) == {"qkai", "loss"}
    assert store.run_metrics(run) == {"loss": [-1], "qkai": [0]}
    kept = store.add_reports(
        run.id, batch(report(1, {"qkai": [0.6]}, scalars={"loss": 1.9, "lr": 1e-3})), rules, max_metric_names=3
    )
    assert (kept.inserted, kept.duplicates) == (3, 0)
    same_id = ReportBatch.model_validate(
        {"batch_id": str(refused.batch_id), "reports": [report(2, scalars={"lr": 1e-3})]}
    )
    assert store.add_reports(run.id, same_id, rules, max_metric_names=3).inserted == 1  # its batch id was never stored
    other = new_run(store, "other")
    done = store.add_reports(
        other.id, batch(report(0, scalars={"a": 1.0, "b": 2.0, "c": 3.0})), rules, max_metric_names=3
    )
    assert done.inserted == 3


def test_the_foreign_key_refuses_a_deleted_or_unknown_id(store: Store):
    """A name a run uses cannot be deleted, and an id that does not exist cannot be recorded for a run."""
    run = new_run(store)
    store.add_reports(run.id, batch(report(0, {"qkai": [0.5]})), RuleSet.default())
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(sa.delete(m.metric_names).where(m.metric_names.c.name == "qkai"))
    with pytest.raises(IntegrityError), store.engine.begin() as conn:
        conn.execute(sa.insert(m.run_metrics).values(run_pk=run.pk, metric_id=10**6))
    assert store.reclaim_metric_names() == 0
    assert store.series(run, "qkai", 0).values == [0.5]


postgres_only = pytest.mark.parametrize("isolated_db_url", ["postgres"], indirect=True)
"""Row locks: SQLite runs one write transaction at a time (BEGIN IMMEDIATE), so these races cannot happen there."""


@postgres_only
def test_a_reclaim_skips_a_name_an_ingest_holds(store: Store):
    """An ingest that took a name no run used yet (its transaction still open) keeps it: the reclaim skips
    it without waiting, and the points land under the name."""
    run = new_run(store)
    with store.engine.begin() as conn:
        conn.execute(sa.insert(m.metric_names).values(name="fresh"))  # used by no run, a reclaim candidate
    with store.engine.connect() as ingesting:
        tx = ingesting.begin()
        b = batch(report(0, {"fresh": [0.25, 0.5]}))
        ingest.write_batch(ingesting, run.id, b, ingest.flatten(b), RuleSet.default(), 0.0)
        with store.engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL lock_timeout = '20s'")  # a wait would be a failure, not a hang
            assert metric_names.reclaim(conn) == 0
        tx.commit()
    assert store.reclaim_metric_names() == 0
    assert store.series(run, "fresh", 1).values == [0.5]


@postgres_only
def test_an_ingest_waits_for_a_reclaim_and_takes_a_new_id(store: Store, db_url: str):
    """A reclaim deletes a name (not yet committed) that an ingest is about to use: the ingest waits, finds
    the row gone, gives the name a new id, and its points are read back under the name."""
    run = new_run(store)
    with store.engine.begin() as conn:
        old_id = conn.execute(sa.insert(m.metric_names).values(name="fresh").returning(m.metric_names.c.id)).scalar()
    result: list[object] = []
    with store.engine.connect() as reclaiming:
        tx = reclaiming.begin()
        assert metric_names.reclaim(reclaiming) == 1
        ingester = threading.Thread(
            target=lambda: result.append(
                store.add_reports(run.id, batch(report(0, {"fresh": [0.25]})), RuleSet.default())
            )
        )
        ingester.start()
        _wait_for_a_lock_wait(store, reclaiming)
        tx.commit()
    ingester.join(LOCK_WAIT_S)
    assert not ingester.is_alive()
    assert [(r.inserted, r.duplicates) for r in result] == [(1, 0)]  # type: ignore[attr-defined]
    with store.engine.connect() as conn:
        new_id = conn.execute(sa.select(m.metric_names.c.id).where(m.metric_names.c.name == "fresh")).scalar()
        stored = conn.execute(sa.select(m.points.c.metric_id).where(m.points.c.run_pk == run.pk)).scalars().all()
    assert new_id is not None and new_id != old_id and stored == [new_id]
    assert store.series(run, "fresh", 0).values == [0.25]


def _wait_for_a_lock_wait(store: Store, holder: sa.Connection) -> None:
    """Until another backend of this database waits for a lock that ``holder`` holds."""
    pid = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    deadline = time.monotonic() + LOCK_WAIT_S
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}
            ).scalar()
            if waiting:
                return
            time.sleep(0.05)
    raise AssertionError("the ingest never waited for the reclaim's lock")
