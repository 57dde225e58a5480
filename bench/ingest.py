"""Collector ingest benchmark: qkwatch vs an MLflow tracking server, same machine, same database kind.

Workload: 24 layers x 6 metrics x S steps, one sender (as one agent / one training process):

* qkwatch: ``qkwatch serve --open`` (uvicorn, 1 worker), batches of ``--batch-reports`` reports
  (24 x 6 = 144 points each) posted to ``/v1/runs/{id}/reports``; read-back = the JSONL export.
* MLflow: ``mlflow server`` (1 worker) from its own virtualenv, ``runs/log-batch`` at its
  1,000-metric limit; read-back = ``metrics/get-history`` of every key.

Then a heatmap query of a 100k-step x 48-layer run (2,000 reports, 6 metrics) against qkwatch,
p50/p95 over repeated calls, and ``GET /lambdas`` latency.

MLflow runs in ``bench/.venvs/mlflow`` (git-ignored); create it with::

    python3 -m venv bench/.venvs/mlflow && bench/.venvs/mlflow/bin/pip install mlflow psycopg2-binary

or pass ``--setup-mlflow``. PostgreSQL: ``--pg-url`` (default: the local server); each server gets
a fresh database, dropped afterwards. Usage::

    .venv/bin/python -m bench.ingest --steps 2000            # both databases, both servers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from qkwatch.launch import CollectorProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MLFLOW_VENV = ROOT / "bench" / ".venvs" / "mlflow"
METRICS = ("qkai", "qkai_max", "stable_rank", "attn_entropy", "attn_top1", "pr_gap")


def wait_http(url: str, proc: subprocess.Popen, tries: int = 600) -> None:
    for _ in range(tries):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def server(cmd: list[str], health: str, log: Path, env: dict | None = None) -> Iterator[None]:
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})})
        try:
            wait_http(health, proc)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def database(kind: str, tmp: Path, pg_url: str, label: str, driver: str) -> Iterator[str]:
    """A fresh database URL of ``kind``; ``driver`` is the SQLAlchemy driver the server uses."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / f'{label}.db'}"
        return
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    name = f"bench_{label}_{secrets.token_hex(3)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(pg_url).set(database=name, drivername=driver).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def value(step: int, layer: int, m: int) -> float:
    return round(0.3 + 0.4 * math.sin(step / 97 + layer + m), 6)


def reports(steps: range, layers: int) -> list[dict]:
    return [
        {
            "step": s,
            "time": 1.7e9 + s,
            "layers": {name: [value(s, la, m) for la in range(layers)] for m, name in enumerate(METRICS)},
        }
        for s in steps
    ]


# --- qkwatch -------------------------------------------------------------------------------------


def report_bodies(steps: int, layers: int, batch_reports: int) -> list[str]:
    """The run's report batches as JSON bodies, encoded before any clock starts."""
    return [
        json.dumps({"batch_id": str(uuid.uuid4()), "reports": reports(range(s, min(s + batch_reports, steps)), layers)})
        for s in range(0, steps, batch_reports)
    ]


def post_reports(c: httpx.Client, run_id: str, bodies: list[str]) -> int:
    """POST each body in turn; the points the collector says it inserted."""
    inserted = 0
    for body in bodies:
        r = c.post(f"/v1/runs/{run_id}/reports", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        inserted += r.json()["inserted"]
    return inserted


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


# --- MLflow --------------------------------------------------------------------------------------


def mlflow_ingest(url: str, steps: int, layers: int) -> dict:
    api = f"{url}/api/2.0/mlflow"
    with httpx.Client(timeout=300) as c:
        exp = c.post(f"{api}/experiments/create", json={"name": f"bench-{uuid.uuid4().hex[:6]}"}).json()
        run = c.post(f"{api}/runs/create", json={"experiment_id": exp["experiment_id"], "start_time": 0}).json()
        run_id = run["run"]["info"]["run_id"]
        points = [
            {"key": f"{name}/layer_{la:02d}", "value": value(s, la, m), "timestamp": 1_700_000_000_000 + s, "step": s}
            for s in range(steps)
            for m, name in enumerate(METRICS)
            for la in range(layers)
        ]
        calls = [points[i : i + 1000] for i in range(0, len(points), 1000)]  # log-batch's limit
        # Encoded before the clock starts, as qkwatch's bodies are: only the server's work is timed.
        bodies = [json.dumps({"run_id": run_id, "metrics": metrics}) for metrics in calls]
        t0 = time.perf_counter()
        for body in bodies:
            r = c.post(f"{api}/runs/log-batch", content=body, headers={"content-type": "application/json"})
            r.raise_for_status()
        ingest_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = 0
        for name in METRICS:
            for la in range(layers):
                n += len(mlflow_history(c, api, run_id, f"{name}/layer_{la:02d}"))
        read_s = time.perf_counter() - t0
    assert n == len(points), (n, len(points))
    return {
        "points": len(points),
        "ingest_s": ingest_s,
        "points_per_s": len(points) / ingest_s,
        "readback_s": read_s,
        "requests": len(calls),
    }


def mlflow_history(c: httpx.Client, api: str, run_id: str, key: str) -> list:
    out, token = [], None
    while True:
        params = {"run_id": run_id, "metric_key": key, "max_results": 25000, **({"page_token": token} if token else {})}
        r = c.get(f"{api}/metrics/get-history", params=params)
        r.raise_for_status()
        body = r.json()
        out += body.get("metrics", [])
        token = body.get("next_page_token")
        if not token:
            return out


def run_mlflow(kind: str, tmp: Path, pg_url: str, args: argparse.Namespace) -> dict:
    mlflow = MLFLOW_VENV / "bin" / "mlflow"
    with database(kind, tmp, pg_url, "mlflow", "postgresql+psycopg2") as db:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        artifacts = tmp / f"mlartifacts-{kind}"
        cmd = [
            str(mlflow),
            "server",
            "--backend-store-uri",
            db,
            "--default-artifact-root",
            str(artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ]
        with server(cmd, f"{url}/health", tmp / f"mlflow-{kind}.log"):
            return mlflow_ingest(url, args.steps, args.layers)


def setup_mlflow() -> None:
    if not (MLFLOW_VENV / "bin" / "mlflow").exists():
        subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_VENV)], check=True)
        subprocess.run([str(MLFLOW_VENV / "bin" / "pip"), "install", "-q", "mlflow", "psycopg2-binary"], check=True)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch-reports", type=int, default=10, help="reports per qkwatch batch")
    p.add_argument("--db", default="sqlite,postgres")
    p.add_argument(
        "--pg-url", default=os.environ.get("QKWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--setup-mlflow", action="store_true", help="create bench/.venvs/mlflow first")
    p.add_argument("--heatmap-steps", type=int, default=100_000)
    p.add_argument("--heatmap-layers", type=int, default=48)
    p.add_argument("--heatmap-reports", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        help="N > 0: only the concurrent mode: N client processes, each sending a run of --steps reports at once",
    )
    p.add_argument("--workers", type=int, default=1, help="qkwatch serve --workers, in the concurrent mode")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "ingest.json")
    args = p.parse_args()
    if args.clients > 0:
        return concurrent_main(args)
    if args.setup_mlflow:
        setup_mlflow()
    with_mlflow = not args.no_mlflow and (MLFLOW_VENV / "bin" / "mlflow").exists()
    if not args.no_mlflow and not with_mlflow:
        print(f"no MLflow in {MLFLOW_VENV}: pass --setup-mlflow (or --no-mlflow)", file=sys.stderr)
        return 2
    results: dict = {
        "steps": args.steps,
        "layers": args.layers,
        "metrics": len(METRICS),
        "batch_reports": args.batch_reports,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    tmp = Path(tempfile.mkdtemp(prefix="qkwatch-bench-"))
    try:
        for kind in args.db.split(","):
            row = {"qkwatch": run_qkwatch(kind, tmp, args.pg_url, args)}
            if with_mlflow:
                row["mlflow"] = run_mlflow(kind, tmp, args.pg_url, args)
                row["ratio"] = row["qkwatch"]["points_per_s"] / row["mlflow"]["points_per_s"]
            results[kind] = row
            print(json.dumps({kind: row}, indent=2), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results, with_mlflow))
    return 0


def concurrent_main(args: argparse.Namespace) -> int:
    results: dict = {"steps": args.steps, "layers": args.layers, "batch_reports": args.batch_reports}
    tmp = Path(tempfile.mkdtemp(prefix="qkwatch-bench-"))
    try:
        for kind in args.db.split(","):
            results[kind] = run_concurrent(kind, tmp, args.pg_url, args)
            print(json.dumps({kind: results[kind]}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print("| database | clients | workers | points | seconds | points/s |\n|---|---:|---:|---:|---:|---:|")
    for kind in args.db.split(","):
        r = results[kind]
        print(
            f"| {kind} | {r['clients']} | {r['workers']} | {r['points']:,} | {r['ingest_s']:.2f} | "
            f"{r['points_per_s']:,.0f} |"
        )
    return 0


def table(results: dict, with_mlflow: bool) -> str:
    lines = [
        "| database | server | points | ingest s | points/s | read-back s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind in ("sqlite", "postgres"):
        if kind not in results:
            continue
        for name in ("qkwatch", "mlflow") if with_mlflow else ("qkwatch",):
            r = results[kind][name]
            ratio = f"{results[kind]['ratio']:.1f}x" if name == "qkwatch" and with_mlflow else ""
            lines.append(
                f"| {kind} | {name} | {r['points']:,} | {r['ingest_s']:.2f} | {r['points_per_s']:,.0f} | "
                f"{r['readback_s']:.2f} | {ratio} |"
            )
    lines += [
        "",
        "| database | heatmap p50 ms | heatmap p95 ms | lambdas p50 ms | lambdas p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in ("sqlite", "postgres"):
        if kind in results:
            hm = results[kind]["qkwatch"]["heatmap"]
            lines.append(
                f"| {kind} | {hm['heatmap_p50_ms']:.1f} | {hm['heatmap_p95_ms']:.1f} | "
                f"{hm['lambdas_p50_ms']:.2f} | {hm['lambdas_p99_ms']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
