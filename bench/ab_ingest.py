"""Ingest of two checkouts' collectors side by side: ``bench/ingest/``'s workload over HTTP, alternating.

Each round starts each checkout's ``qkwatch serve --open`` (1 worker) on a fresh database, posts the
run's batches of 10 reports (24 layers x 6 metrics, 1,440 points each; the first 10 batches untimed)
one after the other, and times them at the client; the checkout that goes first alternates from round
to round. A checkout is a ``git worktree`` (its collector runs with ``PYTHONPATH`` and the working
directory set to it). Usage::

    git worktree add /tmp/before <commit>
    .venv/bin/python -m bench.ab_ingest /tmp/before . --db postgres --rounds 10

It prints each round's points/s and each side's median; paired rounds are what to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.ingest.workload import database, post_reports, report_bodies
from qkwatch.launch import CollectorProcess


def one_round(root: Path, db_url: str, steps: int, log: Path) -> float:
    """Points/s of one checkout's collector on ``db_url``, the first 10 batches left out of the clock."""
    env = {"QKWATCH_BACKGROUND": "false", "PYTHONPATH": str(root)}
    with (
        CollectorProcess(db_url, log=log, env=env, cwd=root, start_timeout=120) as collector,
        httpx.Client(base_url=collector.url, timeout=120) as c,
    ):
        run = c.post(
            "/v1/runs", json={"project": "bench", "name": f"ab-{uuid.uuid4().hex[:6]}", "config": {"n_layers": 24}}
        ).json()
        bodies = report_bodies(steps, 24, 10)
        post_reports(c, run["id"], bodies[:10])
        t0 = time.perf_counter()
        inserted = post_reports(c, run["id"], bodies[10:])
        return inserted / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path, help="the first checkout (e.g. a worktree of main)")
    p.add_argument("b", type=Path, help="the second checkout")
    p.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument(
        "--pg-url", default=os.environ.get("QKWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    args = p.parse_args()
    roots = {"A": args.a.resolve(), "B": args.b.resolve()}
    got: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="qkwatch-ab-") as tmp:
        for i in range(args.rounds):
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                label = f"ab_{side.lower()}_{i}"
                with database(args.db, Path(tmp), args.pg_url, label, "postgresql+psycopg") as url:
                    rate = one_round(roots[side], url, args.steps, Path(tmp) / f"{label}.log")
                got[side].append(rate)
                print(f"round {i} {side} {rate:,.0f} points/s", flush=True)
    for side, rates in got.items():
        print(f"{side} {roots[side]}: {', '.join(f'{r:,.0f}' for r in rates)}; median {statistics.median(rates):,.0f}")
    faster = sum(b > a for a, b in zip(got["A"], got["B"], strict=True))
    print(f"B faster in {faster} of {args.rounds} paired rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
