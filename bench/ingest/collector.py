"""qkwatch's side of the ingest benchmark: one sender's ingest and read-back, the heatmap and lambdas
latencies of a long run, and concurrent client processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.ingest.workload import METRICS, ROOT, database, post_reports, report_bodies, value
from qkwatch.launch import CollectorProcess


def qkwatch_ingest(url: str, steps: int, layers: int, batch_reports: int) -> dict:
    with httpx.Client(base_url=url, timeout=120) as c:
        run = c.post(
            "/v1/runs",
            json={"project": "bench", "name": f"ingest-{uuid.uuid4().hex[:6]}", "config": {"n_layers": layers}},
        ).json()
        bodies = report_bodies(steps, layers, batch_reports)
        t0 = time.perf_counter()
        inserted = post_reports(c, run["id"], bodies)
        ingest_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = 0
        with c.stream("GET", f"/v1/runs/{run['id']}/export", params={"format": "jsonl"}) as resp:
            for line in resp.iter_lines():
                n += bool(line)
        read_s = time.perf_counter() - t0
    expected = steps * layers * len(METRICS)
    assert inserted == expected and n == expected, (inserted, n, expected)
    return {
        "points": expected,
        "ingest_s": ingest_s,
        "points_per_s": expected / ingest_s,
        "readback_s": read_s,
        "requests": len(bodies),
    }


def qkwatch_heatmap(url: str, steps: int, layers: int, n_reports: int, repeats: int) -> dict:
    stride = steps // n_reports
    with httpx.Client(base_url=url, timeout=120) as c:
        run = c.post(
            "/v1/runs",
            json={"project": "bench", "name": f"heatmap-{uuid.uuid4().hex[:6]}", "config": {"n_layers": layers}},
        ).json()
        all_steps = list(range(0, steps, stride))
        for i in range(0, len(all_steps), 20):
            chunk = all_steps[i : i + 20]
            batch = [
                {
                    "step": s,
                    "time": 1.7e9 + s,
                    "layers": {name: [value(s, la, m) for la in range(layers)] for m, name in enumerate(METRICS)},
                }
                for s in chunk
            ]
            c.post(
                f"/v1/runs/{run['id']}/reports", json={"batch_id": str(uuid.uuid4()), "reports": batch}
            ).raise_for_status()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = c.get(f"/v1/runs/{run['id']}/heatmap", params={"metric": "qkai"})
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
        body = r.json()
        assert len(body["layers"]) == layers and body["steps"], body.keys()
        lam = []
        for _ in range(200):
            t0 = time.perf_counter()
            c.get(f"/v1/runs/{run['id']}/lambdas").raise_for_status()
            lam.append(time.perf_counter() - t0)
    return {
        "reports": len(all_steps),
        "layers": layers,
        "buckets": len(body["steps"]),
        "heatmap_p50_ms": 1000 * statistics.median(times),
        "heatmap_p95_ms": 1000 * _pct(times, 0.95),
        "lambdas_p50_ms": 1000 * statistics.median(lam),
        "lambdas_p99_ms": 1000 * _pct(lam, 0.99),
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_qkwatch(kind: str, tmp: Path, pg_url: str, args: argparse.Namespace) -> dict:
    with (
        database(kind, tmp, pg_url, "qkwatch", "postgresql+psycopg") as db,
        CollectorProcess(
            db, log=tmp / f"qkwatch-{kind}.log", env={"QKWATCH_BACKGROUND": "false"}, cwd=ROOT, start_timeout=120
        ) as collector,
    ):
        out = qkwatch_ingest(collector.url, args.steps, args.layers, args.batch_reports)
        out["heatmap"] = qkwatch_heatmap(
            collector.url, args.heatmap_steps, args.heatmap_layers, args.heatmap_reports, args.repeats
        )
    return out


def _client_run(url: str, steps: int, layers: int, batch_reports: int, barrier: Any) -> tuple[float, float, int]:
    """One concurrent client (a process): its own run, its bodies encoded first, then sent one by one
    once every client is ready; returns (start, end, points inserted), wall-clock seconds."""
    with httpx.Client(base_url=url, timeout=300) as c:
        run = c.post(
            "/v1/runs",
            json={"project": "bench", "name": f"ingest-{uuid.uuid4().hex[:6]}", "config": {"n_layers": layers}},
        ).json()
        bodies = report_bodies(steps, layers, batch_reports)
        barrier.wait()
        t0 = time.time()
        inserted = post_reports(c, run["id"], bodies)
        return t0, time.time(), inserted


def qkwatch_concurrent(url: str, clients: int, steps: int, layers: int, batch_reports: int) -> dict:
    """``clients`` processes, each sending its own run of ``steps`` reports at once; the aggregate rate
    is every point over the time from the first client's start to the last one's end."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(clients) as pool:
        barrier = manager.Barrier(clients)
        out = pool.starmap(_client_run, [(url, steps, layers, batch_reports, barrier)] * clients)
    expected = clients * steps * layers * len(METRICS)
    inserted = sum(n for _, _, n in out)
    assert inserted == expected, (inserted, expected)
    seconds = max(e for _, e, _ in out) - min(s for s, _, _ in out)
    return {"clients": clients, "points": expected, "ingest_s": seconds, "points_per_s": expected / seconds}


def run_concurrent(kind: str, tmp: Path, pg_url: str, args: argparse.Namespace) -> dict:
    workers = ["--workers", str(args.workers)] if args.workers > 1 else []
    with (
        database(kind, tmp, pg_url, "qkwatch", "postgresql+psycopg") as db,
        CollectorProcess(
            db,
            log=tmp / f"qkwatch-{kind}.log",
            env={"QKWATCH_BACKGROUND": "false"},
            cwd=ROOT,
            start_timeout=120,
            args=workers,
            own_group=bool(workers),
        ) as collector,
    ):
        out = qkwatch_concurrent(collector.url, args.clients, args.steps, args.layers, args.batch_reports)
    out["workers"] = args.workers
    return out
