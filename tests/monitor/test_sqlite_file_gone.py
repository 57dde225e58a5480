"""The SQLite file deleted under a running collector (issue 21, L2).

An open SQLite connection keeps writing to a file deleted at its path, and that file is gone for
good when the collector stops: before the fix ``/healthz`` said ok and reports were acknowledged
into it (and the agent dropped them from its spool). Now the collector answers 503, the agent's
sender keeps the reports spooled, and once the file is restored and the collector restarted they
arrive.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from qkwatch.agent.health import Health
from qkwatch.agent.shipping.disk_spool import Spool
from qkwatch.agent.shipping.shipper import Sender
from qkwatch.agent.shipping.transport import HttpTransport
from qkwatch.contract.wire import RunCreate
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.store import Store
from tests.live import LiveCollector

pytestmark = pytest.mark.slow


def report(step: int) -> dict:
    return {"step": step, "time": float(step), "scalars": {"loss": 1.0 + step}, "layers": {"qkai": [0.5, 0.6]}}


def sender_of(spool: Spool, url: str) -> tuple[Sender, Health]:
    health = Health()
    s = Sender(
        spool,
        lambda: HttpTransport(url, None, 10.0),
        batch_max=64,
        flush_seconds=0.05,
        backoff_base=0.05,
        backoff_cap=0.2,
        health=health,
    )
    return s, health


def backup(db: Path, to: Path) -> None:
    """A consistent copy of a live SQLite database (its WAL included), as an operator's backup."""
    with sqlite3.connect(db) as source, sqlite3.connect(to) as target:
        source.backup(target)
    source.close()
    target.close()


def steps_stored(collector: LiveCollector) -> list[int]:
    with collector.client() as c:
        (run,) = c.runs(project="tests", name="r")["data"]
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl") if line.strip()]
    return sorted(r["step"] for r in rows if r["metric"] == "loss")


def test_a_deleted_database_file_is_503_and_the_spooled_reports_arrive_after_a_restore(
    tmp_path: Path, collector: LiveCollector
) -> None:
    db = tmp_path / "collector.db"
    collector.start()
    spool = Spool(tmp_path / "spool")
    spool.write_meta({"project": "tests", "name": "r", "config": {}, "attempt_key": "k", "spool_id": "s"})
    for step in (0, 1):
        spool.append({"attempt_key": "k", "report": report(step)})
    s, health = sender_of(spool, collector.url)
    assert s.deliver_all(time.monotonic() + 120) and health.sent == 2
    backup(db, tmp_path / "backup.db")

    db.unlink()  # what the red team did: the file goes, the collector's connections stay open
    health_answer = httpx.get(f"{collector.url}/healthz", timeout=30)
    assert health_answer.status_code == 503, health_answer.text
    assert health_answer.json()["database"] == "file deleted or replaced; restart the collector"
    assert "retry-after" in health_answer.headers
    assert s.run_id is not None
    direct = httpx.post(
        f"{collector.url}/v1/runs/{s.run_id}/reports",
        json={"batch_id": str(uuid.uuid4()), "reports": [report(9)]},
        timeout=30,
    )
    assert direct.status_code == 503 and "retry-after" in direct.headers, direct.text
    assert not db.exists()  # nothing made a new, empty file where the database was

    for step in (2, 3):  # the agent keeps reporting; its sender meets the 503s
        spool.append({"attempt_key": "k", "report": report(step)})
    s.start()
    deadline = time.monotonic() + 60  # a guard against a hang: it stops at the third refusal
    while health.retried < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close(0.0)
    s._thread.join(30)
    assert health.retried >= 3 and "HTTP 503" in health.last_error, health.last_error
    assert health.sent == 2 and health.dead_lettered == 0
    assert [r.payload["report"]["step"] for r in spool.pending(10)] == [2, 3]  # kept, not dropped

    collector.stop()
    for leftover in (db.with_name("collector.db-wal"), db.with_name("collector.db-shm")):
        leftover.unlink(missing_ok=True)  # the deleted database's, never to be paired with the restored one
    (tmp_path / "backup.db").rename(db)
    collector.start()
    s, health = sender_of(spool, collector.url)  # the next process (or `qkwatch sync`) delivers the spool
    assert s.deliver_all(time.monotonic() + 120) and health.sent == 2
    assert steps_stored(collector) == [0, 1, 2, 3]


def test_a_write_that_commits_as_the_file_goes_is_not_acknowledged(tmp_path: Path) -> None:
    """The window between a write's checkout and its commit: the store looks at the file again after
    committing, so a write that went into a file deleted meanwhile raises (a 503 from the API)
    instead of returning as stored, and nothing after it is handed a connection."""
    db = tmp_path / "c.db"
    engine = make_engine(f"sqlite:///{db}")
    upgrade(engine)
    store = Store(engine)
    try:
        refused = pytest.raises(sa.exc.OperationalError, match="was deleted while the collector had it open")
        with refused, store._write() as conn:  # the transaction every write method of the store runs in
            conn.exec_driver_sql("UPDATE runs SET notes = 'x' WHERE pk < 0")
            db.unlink()
        with pytest.raises(sa.exc.OperationalError, match="was deleted"):
            store.create_or_resume_run(RunCreate(project="p", name="r"))
        assert not db.exists()  # no new, empty file where the database was
    finally:
        store.close()


def test_a_database_file_replaced_under_the_store_is_refused_until_a_restart(tmp_path: Path) -> None:
    """Another file at the path (a backup copied back while the collector runs) is not taken up
    half-way: refused until the collector restarts, which then opens it."""
    db = tmp_path / "c.db"
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    upgrade(engine)
    store = Store(engine)
    try:
        store.create_or_resume_run(RunCreate(project="p", name="before"))
        backup(db, tmp_path / "copy.db")
        (tmp_path / "copy.db").replace(db)
        with pytest.raises(sa.exc.OperationalError, match="was replaced by another file"):
            store.list_runs(projects=None)
    finally:
        store.close()
    restarted = Store(make_engine(url))
    try:
        assert [r.name for r in restarted.list_runs(projects=None)[0]] == ["before"]
    finally:
        restarted.close()
