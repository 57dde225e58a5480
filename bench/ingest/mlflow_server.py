"""MLflow's side of the ingest benchmark: an ``mlflow server`` from its own virtualenv (``bench/.venvs/mlflow``),
its ``runs/log-batch`` ingest and ``metrics/get-history`` read-back.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.ingest.workload import METRICS, ROOT, database, value
from qkwatch.launch import free_port

MLFLOW_VENV = ROOT / "bench" / ".venvs" / "mlflow"


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
