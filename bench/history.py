"""Whole-run read-back: qkwatch's one ``/history`` call vs MLflow's ``get-history`` loop, side by side.

The same run goes into both servers: 24 layers x 6 metrics x S steps (S = 500: 72,000 points), one
MLflow metric key per layer and metric (``qkai/layer_07``), as in bench/ingest/. Then, interleaved
round by round on the same machine and database kind, the whole run is read back:

* qkwatch: ``GET /v1/runs/{id}/history`` (every metric, one call) through ``qkwatch.client``'s HTTP
  client, parsed: with JSON values (the default) and with ``encoding=f64`` (decoded to doubles);
  ``Client.history()`` into a pandas DataFrame; and the six heatmap calls a user needed before
  (``max_steps`` high enough not to bucket);
* MLflow: ``GET /api/2.0/mlflow/metrics/get-history`` for each of the 144 keys (what
  ``MlflowClient.get_metric_history`` sends, without building its entity objects), parsed.

Each side is checked to return every point. MLflow runs from ``bench/.venvs/mlflow`` (see
bench/ingest/, or pass ``--setup-mlflow``). Usage::

    .venv/bin/python -m bench.history                 # SQLite and PostgreSQL, 500 steps
    .venv/bin/python -m bench.history --db sqlite --steps 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.ingest.mlflow_server import MLFLOW_VENV, mlflow_history, server, setup_mlflow
from bench.ingest.workload import METRICS, ROOT, database, reports, value
from qkwatch.client.rest import Client, HistoryGrid
from qkwatch.launch import CollectorProcess, free_port


def load_qkwatch(url: str, steps: int, layers: int) -> str:
    with httpx.Client(base_url=url, timeout=120) as c:
        run = c.post(
            "/v1/runs",
            json={"project": "bench", "name": f"history-{uuid.uuid4().hex[:6]}", "config": {"n_layers": layers}},
        ).json()
        for s in range(0, steps, 20):
            body = {"batch_id": str(uuid.uuid4()), "reports": reports(range(s, min(s + 20, steps)), layers)}
            c.post(f"/v1/runs/{run['id']}/reports", json=body).raise_for_status()
    return run["id"]


def load_mlflow(url: str, steps: int, layers: int) -> tuple[str, list[str]]:
    api = f"{url}/api/2.0/mlflow"
    with httpx.Client(timeout=300) as c:
        exp = c.post(f"{api}/experiments/create", json={"name": f"history-{uuid.uuid4().hex[:6]}"}).json()
        run = c.post(f"{api}/runs/create", json={"experiment_id": exp["experiment_id"], "start_time": 0}).json()
        run_id = run["run"]["info"]["run_id"]
        points = [
            {"key": f"{name}/layer_{la:02d}", "value": value(s, la, m), "timestamp": 1_700_000_000_000 + s, "step": s}
            for s in range(steps)
            for m, name in enumerate(METRICS)
            for la in range(layers)
        ]
        for i in range(0, len(points), 1000):  # log-batch's limit
            c.post(f"{api}/runs/log-batch", json={"run_id": run_id, "metrics": points[i : i + 1000]}).raise_for_status()
    return run_id, [f"{name}/layer_{la:02d}" for name in METRICS for la in range(layers)]


def qkwatch_history(client: Client, run_id: str, encoding: str) -> int:
    body = client._json("GET", f"/v1/runs/{run_id}/history", params={"encoding": encoding})
    if encoding == "f64":
        grids = [HistoryGrid.of(g) for g in body["metrics"].values()]
        return sum(len(g.values) - (g.measured.count(0) if g.measured else 0) for g in grids)
    return sum(len(row) - row.count(None) for g in body["metrics"].values() for row in g["values"])


def qkwatch_frame(client: Client, run_id: str) -> int:
    df = client.history(run_id, frame=True)
    return int(df[list(METRICS)].notna().sum().sum())


def qkwatch_heatmaps(client: Client, run_id: str, steps: int) -> int:
    return sum(
        v is not None for m in METRICS for row in client.heatmap(run_id, m, max_steps=steps)["values"] for v in row
    )


def mlflow_loop(c: httpx.Client, api: str, run_id: str, keys: list[str]) -> int:
    return sum(len(mlflow_history(c, api, run_id, key)) for key in keys)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def compare(kind: str, tmp: Path, args: argparse.Namespace) -> dict:
    points = args.steps * args.layers * len(METRICS)
    q_port = m_port = free_port()
    while m_port == q_port:
        m_port = free_port()
    m_url = f"http://127.0.0.1:{m_port}"
    with (
        database(kind, tmp, args.pg_url, "qkwatch", "postgresql+psycopg") as q_db,
        database(kind, tmp, args.pg_url, "mlflow", "postgresql+psycopg2") as m_db,
    ):
        m_cmd = [
            str(MLFLOW_VENV / "bin" / "mlflow"),
            "server",
            "--backend-store-uri",
            m_db,
            "--default-artifact-root",
            str(tmp / f"mlartifacts-{kind}"),
            "--host",
            "127.0.0.1",
            "--port",
            str(m_port),
            "--workers",
            "1",
        ]
        with (
            CollectorProcess(
                q_db,
                port=q_port,
                log=tmp / f"qkwatch-{kind}.log",
                env={"QKWATCH_BACKGROUND": "false"},
                cwd=ROOT,
                start_timeout=120,
            ) as collector,
            server(m_cmd, f"{m_url}/health", tmp / f"mlflow-{kind}.log"),
        ):
            q_url = collector.url
            t0 = time.perf_counter()
            q_run = load_qkwatch(q_url, args.steps, args.layers)
            m_run, keys = load_mlflow(m_url, args.steps, args.layers)
            print(f"{kind}: loaded {points:,} points into each in {time.perf_counter() - t0:.0f} s", flush=True)
            api = f"{m_url}/api/2.0/mlflow"
            with Client(q_url) as client, httpx.Client(timeout=300) as mc:
                arms = {
                    "qkwatch_history": lambda: qkwatch_history(client, q_run, "json"),
                    "qkwatch_history_f64": lambda: qkwatch_history(client, q_run, "f64"),
                    "qkwatch_dataframe": lambda: qkwatch_frame(client, q_run),
                    "qkwatch_heatmaps": lambda: qkwatch_heatmaps(client, q_run, args.steps),
                    "mlflow_loop": lambda: mlflow_loop(mc, api, m_run, keys),
                }
                for fn in arms.values():  # warm-up: connections, caches, imports
                    fn()
                times: dict[str, list[float]] = {name: [] for name in arms}
                for _ in range(args.rounds):
                    for name, fn in arms.items():
                        seconds, n = timed(fn)
                        assert n == points, (name, n, points)
                        times[name].append(seconds)
    out = {name: {"median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts} for name, ts in times.items()}
    out["points"] = points
    for name in arms:
        out[name]["mlflow_over_this"] = out["mlflow_loop"]["median_s"] / out[name]["median_s"]
    return out


def table(results: dict) -> str:
    lines = [
        "| database | read-back of the whole run | median ms | min ms | MLflow loop / this |",
        "|---|---|---:|---:|---:|",
    ]
    label = {
        "qkwatch_history": "qkwatch `GET /history` (1 call, JSON values, parsed)",
        "qkwatch_history_f64": "qkwatch `GET /history?encoding=f64` (1 call, parsed and decoded)",
        "qkwatch_dataframe": "qkwatch `Client.history()` -> pandas DataFrame (f64)",
        "qkwatch_heatmaps": "qkwatch 6 heatmap calls (before)",
        "mlflow_loop": "MLflow `get-history` x 144 keys",
    }
    for kind in ("sqlite", "postgres"):
        if kind not in results:
            continue
        r = results[kind]
        mlflow = r["mlflow_loop"]["median_s"]
        for name, text in label.items():
            ratio = "" if name == "mlflow_loop" else f"{mlflow / r[name]['median_s']:.0f}x"
            lines.append(
                f"| {kind} | {text} | {1000 * r[name]['median_s']:.1f} | {1000 * r[name]['min_s']:.1f} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.history", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500, help="reports in the run (default 500: 72,000 points)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, each arm once per round, interleaved")
    p.add_argument("--db", default="sqlite,postgres")
    p.add_argument(
        "--pg-url", default=os.environ.get("QKWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    p.add_argument("--setup-mlflow", action="store_true", help="create bench/.venvs/mlflow first")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "history.json")
    args = p.parse_args()
    if args.setup_mlflow:
        setup_mlflow()
    if not (MLFLOW_VENV / "bin" / "mlflow").exists():
        print(f"no MLflow in {MLFLOW_VENV}: pass --setup-mlflow", file=sys.stderr)
        return 2
    results: dict = {
        "steps": args.steps,
        "layers": args.layers,
        "metrics": len(METRICS),
        "rounds": args.rounds,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    tmp = Path(tempfile.mkdtemp(prefix="qkwatch-history-"))
    try:
        for kind in args.db.split(","):
            try:
                results[kind] = compare(kind, tmp, args)
            except Exception:
                for log in sorted(tmp.glob("*.log")):
                    print(f"--- {log.name}\n" + "".join(log.read_text().splitlines(True)[-15:]), file=sys.stderr)
                raise
            print(json.dumps({kind: {k: v for k, v in results[kind].items()}}, indent=2), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
