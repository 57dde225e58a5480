"""A fleet: collector replicas behind HAProxy over one PostgreSQL, fed by simulated agents.

What it builds, on this machine's loopback:

* a fresh PostgreSQL database (``--pg-url``, the local server by default), migrated, with one
  ingest+read token per run; dropped at the end;
* ``--replicas`` ``qkwatch serve --workers N`` processes (each in a process group of its own);
* HAProxy (``/usr/sbin/haproxy``) in front of them on a free port, round robin, health checks on
  ``GET /healthz`` every 500 ms (down after 2 failures, up after 2 successes), its config written
  to the work folder;
* ``--ranks`` simulated agent ranks, ``--ranks-per-run`` per run of ``--layers`` layers, spread
  over ``--agent-procs`` processes. Each rank is the real agent's delivery path: its reports go
  through ``qkwatch/agent/report.py: encode`` (a :class:`qkwatch.agent.report.Packed` of synthetic
  per-layer values, as ``Agent._write_report`` spools it), into a real ``qkwatch/agent/shipping/disk_spool.py:
  Spool``, shipped by a real ``qkwatch/agent/shipping/shipper.py: Sender`` over ``qkwatch/agent/shipping/transport.py:
  HttpTransport`` (timed by a wrapper); rank 0 of each run creates the run with
  ``qkwatch/agent/lambdas/poller.py: fetch_first``, logs a loss every step and polls its lambdas with the real
  ``LambdaPoller``. Rank r owns the layers ``l % world == r``, as under FSDP2.

Values are functions of (run, layer, step), so a replay sends the same numbers. Every other run
"collapses": QKAI of layers 20-25 and 40 rises monotonically through 0.70 (and their attention
entropy toward 0.95), so the default rules raise ``qkai_high`` on those 7 layers and one
``collapse_band`` over 20-25, once each; the other layers stay far below.

Midway one replica is killed with SIGKILL (all its processes) and restarted after
``--down-seconds``; the agents' spools and retries and HAProxy's health checks carry the load.

Measured: POST latency as the agents see it (p50, p99, max) and delivery latency (a report's time
to the collector's 2xx); points sent against points stored, counted in PostgreSQL (and their value
sums); alerts per (run, rule, layer), read in the database and from every replica's REST API
directly; lambdas from every replica's ``GET .../lambdas`` directly (and every answer any agent or
the sampler saw) against each other and against the EMA of the entropies the agents sent; the
database's bytes per stored point (``pg_total_relation_size``).

Usage (from the repository root)::

    .venv/bin/python -m bench.fleet                                  # the full run: 5 min at 16, 64, 256 ranks
    .venv/bin/python -m bench.fleet --duration 60 --ranks 16,64      # a shorter pass

Figures go to ``bench/out/fleet.json`` (git-ignored) and the plot to ``bench/fleet.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.fleet.agents import agent_process
from bench.fleet.checks import problems
from bench.fleet.config import (
    HAPROXY,
    PG_ADMIN_URL,
    ROOT,
    FleetConfig,
)
from bench.fleet.report import goals, plot, table
from bench.fleet.session import run_fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,64,256", help="comma-separated rank counts, one session each")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load per session")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks-per-run", type=int, default=4)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--agent-procs", type=int, default=2)
    parser.add_argument("--no-kill", action="store_true", help="no kill -9 midway")
    parser.add_argument(
        "--drain",
        type=float,
        help="seconds the agents may take to drain their spools after the load (3 x duration + 60)",
    )
    parser.add_argument("--pg-url", default=PG_ADMIN_URL, help="PostgreSQL server (a fresh database per session)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "fleet.json"))
    parser.add_argument("--png", default=str(ROOT / "bench" / "fleet.png"))
    parser.add_argument("--note", default="", help="a line under the plot's title (e.g. where it ran)")
    parser.add_argument("--agents", type=Path, help=argparse.SUPPRESS)  # one agent process (internal)
    args = parser.parse_args(argv)
    if args.agents is not None:
        agent_process(args.agents)
        return 0
    if shutil.which(HAPROXY) is None:
        parser.error(f"{HAPROXY} not found (apt-get install haproxy)")
    sessions = []
    for ranks in [int(x) for x in args.ranks.split(",")]:
        cfg = FleetConfig(
            replicas=args.replicas,
            workers=args.workers,
            ranks=ranks,
            ranks_per_run=args.ranks_per_run,
            layers=args.layers,
            duration=args.duration,
            kill_at=None if args.no_kill else 0.5,
            agent_procs=args.agent_procs,
            pg_admin_url=args.pg_url,
            drain_seconds=args.drain,
        )
        with tempfile.TemporaryDirectory(prefix="qkwatch-fleet-") as tmp:
            started = time.time()
            result = run_fleet(cfg, Path(tmp))
            result["wall_s"] = time.time() - started
            result["load_average"] = os.getloadavg()
        result["problems"] = problems(result)
        sessions.append(result)
        print(table([result]))
        for line in result["problems"]:
            print(f"PROBLEM: {line}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(sessions, indent=1, default=str))
    print(table(sessions))
    print(goals(sessions))
    print(f"wrote {out}")
    if len(sessions) > 1:
        plot(sessions, Path(args.png), args.note)
        print(f"wrote {args.png}")
    return 1 if any(s["problems"] for s in sessions) else 0


if __name__ == "__main__":
    raise SystemExit(main())
