"""Deleting a run while six writers post its reports to a real collector (issue 21, M3).

A real ``qkwatch serve`` over a database of its own; six threads post reports of one run over
HTTP while a seventh deletes the run. Every trial holds the same promises on both databases:
no answer is a 5xx (PostgreSQL once answered deadlocks as 503 "database unavailable"), the
delete is a 204, a report that comes after the delete is a 404 naming the run (the answer to an
unknown run), and no table keeps a row of a deleted run.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from qkwatch.launch import CollectorProcess
from qkwatch.monitor.store import models as m
from tests.live import ROOT

pytestmark = pytest.mark.slow

WRITERS = 6
TRIALS = 5
LAYERS = 8
BEFORE_DELETE = 3
"""Batches every writer has stored before the delete is sent."""
MAX_BATCHES = 400
"""A writer stops after this many batches whatever happens (the delete must have come long before)."""


@pytest.fixture
def live(isolated_db_url: str, tmp_path: Path) -> Iterator[CollectorProcess]:
    with CollectorProcess(isolated_db_url, log=tmp_path / "collector.log", cwd=ROOT) as collector:
        yield collector


def batch(step: int) -> dict:
    """One report that writes every table a run has: points, frames, latest, events, the running
    entropies, and alerts (qkai above the collapse threshold on every layer) with their notifications."""
    return {
        "batch_id": str(uuid.uuid4()),
        "reports": [
            {
                "step": step,
                "time": float(step),
                "layers": {"qkai": [0.95] * LAYERS, "attn_entropy": [0.9] * LAYERS, "stable_rank": [3.0] * LAYERS},
                "heads": {"qkai": [[0.9, 0.95]] * LAYERS},
                "scalars": {"loss": 2.0},
                "events": [{"kind": "note", "message": f"step {step}"}],
            }
        ],
    }


class Trial:
    """Six writers of one run and one delete; what each of them was answered."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url, self.run_id = url, run_id
        self.answers: list[list[int]] = [[] for _ in range(WRITERS)]
        self.after_delete: list[httpx.Response] = []
        self.stored = threading.Condition()

    def write(self, w: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            for i in range(MAX_BATCHES):
                r = http.post(f"/v1/runs/{self.run_id}/reports", json=batch(w + i * WRITERS))
                with self.stored:
                    self.answers[w].append(r.status_code)
                    self.stored.notify_all()
                if r.status_code != 200:
                    self.after_delete.append(r)
                    return

    def delete(self) -> httpx.Response:
        with self.stored:  # a wait on the writers' progress, not on the clock
            self.stored.wait_for(
                lambda: all(a.count(200) >= BEFORE_DELETE or (a and a[-1] != 200) for a in self.answers)
            )
        return httpx.delete(f"{self.url}/v1/runs/{self.run_id}", timeout=120)


def rows_of(db_url: str, run_pks: list[int]) -> dict[str, int]:
    """Rows left of the runs ``run_pks`` in every table that has a ``run_pk``, and notifications
    whose alert is gone."""
    engine = sa.create_engine(sa.make_url(db_url))
    try:
        with engine.connect() as conn:
            left = {
                t.name: conn.execute(sa.select(sa.func.count()).select_from(t).where(t.c.run_pk.in_(run_pks))).scalar()
                for t in m.metadata.sorted_tables
                if "run_pk" in t.c
            }
            n, a = m.notifications, m.alerts
            left["notifications"] = conn.execute(
                sa.select(sa.func.count()).select_from(n).where(n.c.alert_id.not_in(sa.select(a.c.id)))
            ).scalar()
            left["runs"] = conn.execute(
                sa.select(sa.func.count()).select_from(m.runs).where(m.runs.c.pk.in_(run_pks))
            ).scalar()
    finally:
        engine.dispose()
    return {table: count for table, count in left.items() if count}


def pk_of(db_url: str, run_id: str) -> int:
    engine = sa.create_engine(sa.make_url(db_url))
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(m.runs.c.pk).where(m.runs.c.id == run_id)).scalar_one()
    finally:
        engine.dispose()


def test_deleting_a_run_under_six_writers_leaves_nothing_and_answers_no_5xx(
    live: CollectorProcess, isolated_db_url: str
) -> None:
    deleted: list[int] = []
    with live.client() as c:
        kept = c.create_run("locks", "kept")
        c.send_reports(kept["id"], batch(0)["reports"])
        for trial in range(TRIALS):
            run = c.create_run("locks", f"deleted-{trial}")
            c.send_reports(run["id"], batch(10_000)["reports"])  # metric names registered before the race
            deleted.append(pk_of(isolated_db_url, run["id"]))
            t = Trial(live.url, run["id"])
            writers = [threading.Thread(target=t.write, args=(w,)) for w in range(WRITERS)]
            for thread in writers:
                thread.start()
            gone = t.delete()
            for thread in writers:
                thread.join()
            assert gone.status_code == 204, gone.text
            assert all(a[:-1] == [200] * (len(a) - 1) for a in t.answers), t.answers  # no 5xx before the end
            assert [r.status_code for r in t.after_delete] == [404] * WRITERS, [
                (r.status_code, r.text) for r in t.after_delete
            ]
            assert all(f"run {run['id']} not found" in r.json()["detail"] for r in t.after_delete)
        assert c.runs(project="locks")["count"] == 1
        assert c.series(kept["id"], "qkai", layer=0)["values"] == [0.95]  # the other run is untouched
    assert rows_of(isolated_db_url, deleted) == {}
