"""``/healthz`` latency while clients flood the collector with 4 MB request bodies (issue 21, M1).

A real ``qkwatch serve`` (tokens required, SQLite) answers ``GET /healthz`` from one prober, one
request at a time every 10 ms, while ``--clients`` processes each POST a 4 MB report batch to
``/v1/runs/{id}/reports`` in a loop. Arms, each ``--seconds`` long:

* ``idle``: the prober alone;
* ``no token``: the bodies carry no ``Authorization`` (401 expected);
* ``read token``: a token without the ``ingest`` scope (403 expected);
* ``ingest token``: a valid token and a body that is JSON to its end but whose last report has a
  negative step, so it is parsed and validated whole and refused (422), nothing stored.

The flooding clients run at ``--client-nice`` (10): on this one machine they stand in for clients
on others, whose CPU time would not be the collector's. ``--client-nice 0`` makes them compete for
the cores as equals, which measures the machine as much as the collector.

``--baseline DIR`` runs the same arms against a second collector started from another checkout
(for example main's code in a git worktree), both up at once, arm by arm in turn, so that the
two are measured in the same minutes. Usage, from the repository root::

    .venv/bin/python -m bench.auth_flood                                  # this checkout only
    .venv/bin/python -m bench.auth_flood --baseline /work/wt-main-ref     # before and after, side by side

The raw latencies and request counts go to ``bench/out/auth_flood.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from qkwatch.launch import CollectorProcess

ROOT = Path(__file__).resolve().parents[1]
BODY_BYTES = 4_000_000
"""The flooders' body: 4 MB, under the collector's default limit of 4 MiB (4,194,304 bytes)."""
PROBE_EVERY_S = 0.01


def batch_body(size: int = BODY_BYTES) -> bytes:
    """A report batch of about ``size`` bytes of ordinary JSON whose last report has step -1: an
    authorised request parses and validates all of it, then gets 422, and nothing is stored."""
    one = {"step": 0, "time": 0.0, "layers": {"qkai": [0.123456789] * 48, "stable_rank": [3.14159265] * 48}}
    per_report = len(json.dumps(one)) + 2
    reports = [{**one, "step": s, "time": float(s)} for s in range(max(1, size // per_report - 1))]
    reports.append({**one, "step": -1})
    return json.dumps({"batch_id": str(uuid.uuid4()), "reports": reports}).encode()


@dataclass
class Arm:
    collector: str
    arm: str
    seconds: float
    probe_ms: list[float] = field(default_factory=list)
    flood_statuses: dict[str, int] = field(default_factory=dict)
    server_cpu_s: float = 0.0

    def summary(self) -> dict[str, float | int | str]:
        ms = sorted(self.probe_ms)
        return {
            "collector": self.collector,
            "arm": self.arm,
            "probes": len(ms),
            "p50_ms": statistics.median(ms),
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "max_ms": ms[-1],
            "flood_requests": sum(self.flood_statuses.values()),
            "flood_statuses": " ".join(f"{k}x{v}" for k, v in sorted(self.flood_statuses.items())),
            "server_cpu_s": self.server_cpu_s,
            "server_cpu_ms_per_flood_request": 1000 * self.server_cpu_s / max(1, sum(self.flood_statuses.values())),
        }


def flood(url: str, path: str, token: str | None, body: bytes, stop_at: float, nice: int, out: mp.Queue) -> None:
    """One flooding client (its own process, so its GIL is not the prober's): POST until ``stop_at``."""
    os.nice(nice)
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.time() < stop_at:
            try:
                status = str(client.post(path, content=body, headers=headers).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            statuses[status] = statuses.get(status, 0) + 1
    out.put(statuses)


def probe(url: str, stop_at: float) -> list[float]:
    """``GET /healthz`` one at a time every 10 ms until ``stop_at``: each answer's latency in ms."""
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            assert client.get("/healthz").status_code == 200
            latencies.append((time.perf_counter() - t0) * 1000)
            time.sleep(PROBE_EVERY_S)
    return latencies


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_arm(name: str, arm: str, url: str, path: str, token: str | None, args: argparse.Namespace, pid: int) -> Arm:
    clients, seconds = args.clients, args.seconds
    result = Arm(name, arm, seconds)
    body = batch_body()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start = time.time() + (2.0 if arm != "idle" else 0.0)  # the flooders' interpreters start first
    stop_at = start + seconds
    n = 0 if arm == "idle" else clients
    procs = [ctx.Process(target=flood, args=(url, path, token, body, stop_at, args.client_nice, out)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start - time.time()))
    cpu = cpu_seconds(pid)
    result.probe_ms = probe(url, stop_at)
    for _ in procs:
        for status, n in out.get(timeout=120).items():
            result.flood_statuses[status] = result.flood_statuses.get(status, 0) + n
    result.server_cpu_s = cpu_seconds(pid) - cpu
    for p in procs:
        p.join()
    return result


def mint(source: Path, db_url: str, *scopes: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "token", "create", "--project", "bench"]
        + [arg for s in scopes for arg in ("--scope", s)]
        + ["--database-url", db_url],
        cwd=source,
        env={**os.environ, "PYTHONPATH": str(source)},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()[0]


class Target:
    """A collector started from the code in ``source``, with an ingest and a read token and one run."""

    def __init__(self, name: str, source: Path, workdir: Path) -> None:
        self.name, self.source = name, source
        workdir.mkdir(parents=True)
        self.db_url = f"sqlite:///{workdir / 'collector.db'}"
        self.process = CollectorProcess(
            self.db_url,
            log=workdir / "collector.log",
            open_access=False,
            cwd=source,
            env={"PYTHONPATH": str(source)},
        )

    def start(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "qkwatch.cli", "db", "upgrade", "--database-url", self.db_url],
            cwd=self.source,
            env={**os.environ, "PYTHONPATH": str(self.source)},
            check=True,
            capture_output=True,
        )
        self.ingest, self.read = mint(self.source, self.db_url, "ingest"), mint(self.source, self.db_url, "read")
        self.process.start()
        with httpx.Client(base_url=self.process.url, timeout=30) as c:
            run = c.post(
                "/v1/runs",
                json={"project": "bench", "name": "flood"},
                headers={"authorization": f"Bearer {self.ingest}"},
            ).raise_for_status()
        self.path = f"/v1/runs/{run.json()['id']}/reports"

    def stop(self) -> None:
        self.process.stop()


def commit_of(source: Path) -> str:
    done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.auth_flood", description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout whose collector is measured beside this one")
    parser.add_argument("--clients", type=int, default=4, help="flooding client processes (default 4)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each arm (default 15)")
    parser.add_argument(
        "--client-nice",
        type=int,
        default=10,
        help="niceness of the flooding clients (default 10: they stand in for other machines, so the "
        "collector comes first for the CPU they share here; 0 makes them compete as equals)",
    )
    parser.add_argument("--arms", default="idle,no token,read token,ingest token")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",")]
    with tempfile.TemporaryDirectory(prefix="qkwatch-auth-flood-") as tmp:
        sources = [("this checkout", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
        targets = [
            Target(f"{name} ({commit_of(src)})", src, Path(tmp) / str(i)) for i, (name, src) in enumerate(sources)
        ]
        results: list[Arm] = []
        try:
            for t in targets:
                t.start()
            for arm in arms:
                for t in targets:
                    token = {"idle": None, "no token": None, "read token": t.read, "ingest token": t.ingest}[arm]
                    assert t.process.proc is not None
                    pid = t.process.proc.pid
                    r = run_arm(t.name, arm, t.process.url, t.path, token, args, pid)
                    results.append(r)
                    print(json.dumps(r.summary()), flush=True)
        finally:
            for t in targets:
                t.stop()
    print_table([r.summary() for r in results], args)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "auth_flood.json").write_text(json.dumps([asdict(r) for r in results]))


def print_table(rows: list[dict[str, float | int | str]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.clients} flooding clients (nice {args.client_nice}), {BODY_BYTES:,}-byte bodies, "
        f"{args.seconds:g} s per arm\n"
    )
    print(
        "| collector | flood | /healthz p50 ms | p99 ms | max ms | probes | flood requests (status x count) "
        "| server CPU s | server CPU ms per flood request |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        per_request = f"{r['server_cpu_ms_per_flood_request']:.1f}"
        print(
            f"| {r['collector']} | {r['arm']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} "
            f"| {r['probes']} | {r['flood_requests']} ({r['flood_statuses']}) | {r['server_cpu_s']:.1f} "
            f"| {per_request if r['flood_requests'] else '-'} |"
        )


if __name__ == "__main__":
    main()
