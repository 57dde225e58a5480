"""Collector ingest against the database's own raw insert of the same rows, side by side (issue 33).

    .venv/bin/python -m bench.ingest_raw [--db sqlite,postgres] [--steps 1920] [--batches 10,64] [--rounds 3]

Workload: one run of 24 layers x 6 metrics x ``--steps`` steps (``bench/ingest/``'s), one sender,
sent in batches of B reports (B x 144 points): 10, and 64, the agent's own ``batch_max_reports``.
For each database kind (SQLite file, PostgreSQL on the local server), alternating within a round:

* **collector**: the JSON bodies (encoded before the clock starts) POSTed in turn over HTTP on
  loopback to ``qkwatch serve --open`` (uvicorn, one worker) over a fresh database: the whole
  path, request parse and validation, the run's lock, the batch id, the points, the frames, the
  latest values, the alert rules and the lambda schedule, one transaction a batch.
* **raw insert**: the same points' rows, built before the clock starts, into a fresh database of
  the same schema (migrated by the same code, so the same primary key, PRAGMAs and server), one
  transaction a batch: SQLite ``executemany`` of the ``INSERT ... ON CONFLICT DO NOTHING`` the store
  runs, rows in key order; PostgreSQL binary ``COPY`` of a payload packed before the clock starts.
  This is the fastest way this machine's database takes those rows, not a peer.

Prints points/s of both and the collector's share of the raw rate beside the goal (>= 85 %),
then, in-process with no HTTP, where a batch's time goes (``bench/ingest_phases.py``'s phases).
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.ingest.workload import METRICS, ROOT, database, report_bodies, value
from qkwatch.launch import CollectorProcess
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.models import LAYER_VALUE

GOAL = 0.85
PG_ADMIN_URL = os.environ.get("QKWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
DRIVER = "postgresql+psycopg"
Row = tuple[int, int, int, int, int, int, float]
"""(run_pk, metric id, head, step, layer, attempt, value): a point as the store's SQLite insert takes it."""


def point_rows(steps: range, layers: int) -> list[Row]:
    """One batch's points in the points' key order (metric id, head, step, layer)."""
    return [
        (1, m + 1, LAYER_VALUE, s, la, 0, value(s, la, m))
        for m in range(len(METRICS))
        for s in steps
        for la in range(layers)
    ]


_COPY_ROW = struct.Struct(">hiiiiiiiiiqiiid")


def copy_payload(rows: list[Row]) -> bytes:
    """Binary COPY of ``rows`` in the column order (run_pk, metric_id, head, layer, step, attempt, value)."""
    body = b"".join(_COPY_ROW.pack(7, 4, r, 4, m, 4, h, 4, la, 8, s, 4, a, 8, v) for r, m, h, s, la, a, v in rows)
    return b"PGCOPY\n\xff\r\n\x00" + bytes(8) + body + b"\xff\xff"


def raw_insert(url: str, batches: list[list[Row]]) -> float:
    """Seconds to insert ``batches[1:]`` into a fresh, migrated database, one transaction each
    (``batches[0]`` first, untimed, as the collector's first batch is)."""
    engine = make_engine(url)
    upgrade(engine)
    raw = engine.raw_connection()
    try:
        driver: Any = raw.driver_connection
        driver.commit()
        if engine.dialect.name == "sqlite":
            insert = _sqlite_insert
            work: list[Any] = list(batches)
        else:
            insert = _postgres_copy
            work = [copy_payload(rows) for rows in batches]  # packed before the clock starts
        insert(driver, work[0])
        start = time.perf_counter()
        for item in work[1:]:
            insert(driver, item)
        return time.perf_counter() - start
    finally:
        raw.close()
        engine.dispose()


def _sqlite_insert(driver: Any, rows: list[Row]) -> None:
    driver.execute("BEGIN IMMEDIATE")
    driver.executemany(
        "INSERT INTO points (run_pk, metric_id, head, step, layer, attempt, value) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        rows,
    )
    driver.commit()


def _postgres_copy(driver: Any, payload: bytes) -> None:
    with driver.cursor() as cur:
        sql = "COPY points (run_pk, metric_id, head, layer, step, attempt, value) FROM STDIN (FORMAT BINARY)"
        with cur.copy(sql) as copy:
            copy.write(payload)
    driver.commit()


def collector_ingest(url: str, bodies: list[str], tmp: Path, label: str) -> float:
    """Seconds to POST ``bodies`` to a collector over a fresh database at ``url``."""
    with (
        CollectorProcess(url, log=tmp / f"{label}.log", env={"QKWATCH_BACKGROUND": "false"}, cwd=ROOT) as collector,
        httpx.Client(base_url=collector.url, timeout=120) as c,
    ):
        run = c.post("/v1/runs", json={"project": "bench", "name": f"raw-{uuid.uuid4().hex[:6]}"}).json()
        c.post(f"/v1/runs/{run['id']}/reports", content=bodies[0], headers={"content-type": "application/json"})
        start = time.perf_counter()
        for body in bodies[1:]:
            r = c.post(f"/v1/runs/{run['id']}/reports", content=body, headers={"content-type": "application/json"})
            r.raise_for_status()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest_raw", description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default="sqlite,postgres")
    p.add_argument("--steps", type=int, default=1920, help="steps per run (a multiple of each batch size is best)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batches", default="10,64", help="reports per batch, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pg-url", default=PG_ADMIN_URL)
    args = p.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}")
    print("\n| database | reports a batch | collector points/s | raw insert points/s | collector / raw | goal |")
    print("|---|---:|---:|---:|---:|---|")
    for kind in args.db.split(","):
        for size in (int(b) for b in args.batches.split(",")):
            bodies = report_bodies(args.steps, args.layers, size)
            batches = [point_rows(range(s, min(s + size, args.steps)), args.layers) for s in range(0, args.steps, size)]
            # the collector's first batch (run warm-up) is not timed; neither is the raw one's
            timed_points = sum(len(b) for b in batches[1:])
            ours, raws = [], []
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory() as tmp_name:
                    tmp = Path(tmp_name)
                    order = ("collector", "raw") if r % 2 == 0 else ("raw", "collector")
                    for arm in order:
                        with database(kind, tmp, args.pg_url, f"{arm}{r}", DRIVER) as url:
                            if arm == "collector":
                                ours.append(timed_points / collector_ingest(url, bodies, tmp, f"{kind}-{size}-{r}"))
                            else:
                                raws.append(timed_points / raw_insert(url, batches))
            a, b = statistics.median(ours), statistics.median(raws)
            verdict = "met" if a / b >= GOAL else "not met"
            print(f"| {kind} | {size} | {a:,.0f} | {b:,.0f} | **{a / b:.0%}** | >= {GOAL:.0%}: {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
