"""``qkwatch demo``: a collector and a small CPU training run with the agent, on this machine.

Starts ``qkwatch serve --open`` on a loopback port over ``.qkwatch/demo/collector.db``, prints the
URL of the live page, and trains the ``small_cpu`` recipe (seed 001's QK-identical init on two
middle layers induces the collapse band; RAA's entropy-floor schedule pulls it back) with the
agent attached. Ctrl-C stops both; ``--keep-serving`` leaves the collector up after training.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="collector + a small CPU training run with the agent; prints the URL",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="small_cpu", help="trainer recipe (default small_cpu)")
    p.add_argument("--port", type=int, default=0, help="collector port (default: a free one)")
    p.add_argument("--dir", default=".qkwatch/demo", help="where the database, spool and run live")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--keep-serving", action="store_true", help="leave the collector running after training")
    p.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    collector = subprocess.Popen(
        [sys.executable, "-m", "qkwatch.cli", "serve", "--open", "--host", "127.0.0.1", "--port", str(port),
         "--database-url", f"sqlite:///{workdir / 'collector.db'}"],
        stdout=open(workdir / "collector.log", "a"), stderr=subprocess.STDOUT,  # noqa: SIM115
    )
    try:
        if not _wait_healthy(url, collector):
            print(f"qkwatch demo: the collector did not start; see {workdir / 'collector.log'}", file=sys.stderr)
            return 1
        run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        print(f"\n  collector:  {url}\n  metrics:    {url}/metrics\n", flush=True)
        env = {**os.environ, "QKWATCH_URL": url, "QKWATCH_PROJECT": "demo", "QKWATCH_RUN": run,
               "QKWATCH_SPOOL": str(workdir / "spool")}
        sets = [item for kv in args.set for item in ("--set", kv)]
        out = workdir / "runs" / run
        train = subprocess.Popen([sys.executable, "-m", "qkwatch.cli", "train", "--recipe", args.recipe,
                                  "--out", str(out), *sets], env=env)
        _announce_page(url, run, train)
        if train.wait() != 0:
            return train.returncode
        print(f"\ntraining finished; its reports are in {workdir / 'collector.db'}. The trained model:", flush=True)
        subprocess.run([sys.executable, "-m", "qkwatch.cli", "analyze", str(out / "model.pt"), "--no-spectra"])
        if args.keep_serving:
            print(f"collector still serving on {url}; Ctrl-C to stop it", flush=True)
            collector.wait()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if collector.poll() is None:
            collector.send_signal(signal.SIGTERM)
            collector.wait(timeout=30)


def _announce_page(url: str, run: str, train: subprocess.Popen, timeout: float = 120.0) -> None:
    """Print the live page's link once the agent has created the run."""
    from monitor.client import Client, CollectorError

    deadline = time.monotonic() + timeout
    with Client(url) as client:
        while time.monotonic() < deadline and train.poll() is None:
            try:
                runs = client.runs(project="demo", name=run)["data"]
            except CollectorError:
                runs = []
            if runs:
                print(f"\n  live page:  {url}/?run={runs[0]['id']}   (the collapse band forms in layers 2-3, "
                      "then RAA pulls it back)\n", flush=True)
                return
            time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.2)
    return False
