"""What reading a batch's metric ids in its own transaction costs (issue 21, H1): the one query of
``monitor.store.metric_names.ids_for_batch`` against the whole ``Store.add_reports`` of the batch.

Workload: one run, batches of 10 reports x 24 layers x 6 metrics plus 2 scalars (1,460 points,
8 names, all known to the run after the first batch: the steady state), on a fresh SQLite file and
a fresh PostgreSQL database, in process (no HTTP). Per database: the median of ``--batches``
``add_reports`` calls, and the median of as many ``ids_for_batch`` calls, each in a write
transaction of its own that is rolled back (the lock it takes goes with it). Usage::

    .venv/bin/python -m bench.metric_names [--batches 300] [--db sqlite|postgres|both] [--pg-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from bench.ingest.workload import database
from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.metric_names import ids_for_batch
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.runs import lookup
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.store.values import ingest
from qkwatch.rules.ruleset import RuleSet

METRICS = ("qkai", "qkai_max", "stable_rank", "attn_entropy", "attn_top1", "pr_gap")
LAYERS = 24
REPORTS = 10


def batch(first_step: int) -> ReportBatch:
    reports = [
        {
            "step": s,
            "time": float(s),
            "layers": {m: [0.3 + 0.01 * la + 0.001 * i for la in range(LAYERS)] for i, m in enumerate(METRICS)},
            "scalars": {"loss": 5.0 - s / 1e4, "lr": 3e-4},
        }
        for s in range(first_step, first_step + REPORTS)
    ]
    return ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports})


def measure(url: str, batches: int) -> dict[str, float]:
    engine = make_engine(url)
    upgrade(engine)
    store = Store(engine)
    try:
        run, _ = store.create_or_resume_run(RunCreate(project="bench", name="names"))
        rules = RuleSet.default()
        store.add_reports(run.id, batch(0), rules)  # the run's names exist from here on
        whole = []
        for i in range(1, batches + 1):
            b = batch(i * REPORTS)
            t0 = time.perf_counter()
            store.add_reports(run.id, b, rules, max_metric_names=1000)
            whole.append(time.perf_counter() - t0)
        names = ingest.metric_names(ingest.flatten(batch(0)))
        query = []
        for _ in range(batches):
            with engine.connect().execution_options(write=True) as conn:
                tx = conn.begin()
                row = lookup.locked(conn, run.id)
                t0 = time.perf_counter()
                ids_for_batch(conn, row, names, 1000)
                query.append(time.perf_counter() - t0)
                tx.rollback()
        add_ms, ids_ms = 1e3 * statistics.median(whole), 1e3 * statistics.median(query)
        return {"add_reports_ms": add_ms, "ids_for_batch_ms": ids_ms, "share": ids_ms / add_ms}
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    print("| database | `add_reports` median ms | `ids_for_batch` median ms | share of the batch |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            with database(kind, Path(tmp), args.pg_url, "names", sa.make_url(args.pg_url).drivername) as url:
                r = measure(url, args.batches)
            label = "SQLite" if kind == "sqlite" else "PostgreSQL"
            print(f"| {label} | {r['add_reports_ms']:.2f} | {r['ids_for_batch_ms']:.3f} | {100 * r['share']:.1f} % |")


if __name__ == "__main__":
    main()
