"""Where a batch's time goes inside the store: ``Store.add_reports`` called in-process, no HTTP.

The workload of ``bench/ingest/`` (24 layers x 6 metrics, batches of 10 reports), parsed with
``ReportBatch.model_validate_json`` as the collector does, then stored; each phase of
``monitor.store.values.ingest.write_batch`` is timed by wrapping its function for this process only.
"Rest" is what no phase covers: the run's row locked, the transaction's begin and commit. Usage::

    .venv/bin/python -m bench.ingest_phases                 # SQLite, 2,000 steps
    .venv/bin/python -m bench.ingest_phases --db postgres   # a fresh PostgreSQL database, dropped after

To compare two trees, run it from a ``git worktree`` of each (``PYTHONPATH=<worktree>``).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ingest.workload import database, report_bodies
from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.runs import events, lambdas
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.store.values import ingest
from qkwatch.rules.ruleset import RuleSet

PG_ADMIN_URL = os.environ.get("QKWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
"""The PostgreSQL server (as ``bench.ingest``'s ``--pg-url``); a fresh database on it, dropped after."""
DRIVER = "postgresql+psycopg"
PHASES = {
    ingest: ["flatten", "_record_batch", "ids_for_batch", "insert_points", "insert_frames", "_upsert_latest"],
    lambdas: ["feed_schedule"],
    events: ["insert"],
}
LATE = ["evaluate_batch", "_touch_run"]  # looked up in ingest's namespace


def _timed(spent: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


def _instrument(spent: Counter[str]) -> None:
    for module, names in PHASES.items():
        for name in names:
            setattr(module, name, _timed(spent, f"{module.__name__.rsplit('.', 1)[-1]}.{name}", getattr(module, name)))
    for name in LATE:
        setattr(ingest, name, _timed(spent, name, getattr(ingest, name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch-reports", type=int, default=10)
    args = p.parse_args()
    spent: Counter[str] = Counter()
    _instrument(spent)
    bodies = report_bodies(args.steps, args.layers, args.batch_reports)
    with tempfile.TemporaryDirectory() as tmp, database(args.db, Path(tmp), PG_ADMIN_URL, "phases", DRIVER) as url:
        engine = make_engine(url)
        upgrade(engine)
        store = Store(engine)
        try:
            run, _ = store.create_or_resume_run(RunCreate(project="bench", name="phases"))
            rules = RuleSet.default()
            parse = add = 0.0
            for body in bodies:
                t0 = time.perf_counter()
                batch = ReportBatch.model_validate_json(body)
                t1 = time.perf_counter()
                store.add_reports(run.id, batch, rules)
                parse, add = parse + t1 - t0, add + time.perf_counter() - t1
        finally:
            store.close()
    n, points = len(bodies), args.steps * args.layers * 6
    print(f"{args.db}: {n} batches, {points:,} points; store alone {points / add:,.0f} points/s")
    print(f"  {'parse (model_validate_json)':32s} {parse / n * 1e3:6.2f} ms a batch")
    print(f"  {'Store.add_reports':32s} {add / n * 1e3:6.2f} ms a batch, of which:")
    for name, s in spent.most_common():
        print(f"    {name:30s} {s / n * 1e3:6.2f} ms")
    print(f"    {'rest (lock, begin, commit)':30s} {(add - sum(spent.values())) / n * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
