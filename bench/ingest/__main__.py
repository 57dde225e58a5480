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
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.ingest.collector import run_concurrent, run_qkwatch
from bench.ingest.mlflow_server import MLFLOW_VENV, run_mlflow, setup_mlflow
from bench.ingest.workload import METRICS, ROOT


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
