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
  per-layer values, as ``Agent._write_report`` spools it), into a real ``qkwatch/agent/disk_spool.py:
  Spool``, shipped by a real ``qkwatch/agent/shipper.py: Sender`` over ``qkwatch/agent/transport.py:
  HttpTransport`` (timed by a wrapper); rank 0 of each run creates the run with
  ``qkwatch/agent/lambdas.py: fetch_first``, logs a loss every step and polls its lambdas with the real
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
import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from qkwatch.launch import CollectorProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("QKWATCH_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
HAPROXY = "/usr/sbin/haproxy"
PROJECT = "fleet"

WEIGHT_METRICS = ("qkai", "qkai_max", "stable_rank", "qk_cos")
"""Per-layer weight metrics of every report (``qkwatch/agent/metrics/summary.py: weight_metrics``)."""
SPECTRA_METRICS = ("wq_fro", "wk_fro", "wq_spec", "wk_spec", "wk_erank")
"""Projection spectra, on every ``spectra_every``-th report."""
ACTIVATION_METRICS = (
    "attn_entropy",
    "attn_entropy_nats",
    "attn_top1",
    "attn_top5",
    "attn_gap",
    "attn_gap1",
    "attn_srank",
    "logit_mean",
    "logit_std",
    "logit_max",
    "qk_erank",
    "pr_q",
    "pr_k",
    "pr_gap",
)
"""Per-layer activation metrics of every report (``qkwatch/agent/probe.py``), as a real report carries them."""
HOT_LAYERS = (20, 21, 22, 23, 24, 25, 40)
"""Layers whose QKAI rises through the threshold in a collapsing run (20-25 are a band, 40 alone)."""
BAND = (20, 21, 22, 23, 24, 25)
THRESHOLD = 0.70


@dataclass
class FleetConfig:
    """One fleet session."""

    replicas: int = 2
    """``qkwatch serve`` processes behind the balancer."""
    workers: int = 2
    """``--workers`` of each replica."""
    ranks: int = 64
    """Simulated agent ranks in all."""
    ranks_per_run: int = 4
    """Ranks of one run (its world size); ranks / ranks_per_run runs."""
    layers: int = 48
    duration: float = 300.0
    """Seconds of load."""
    step_seconds: float = 0.1
    """A simulated training step every this many seconds (rank 0 logs a loss at each)."""
    report_every: int = 5
    """A full report every this many steps."""
    spectra_every: int = 10
    """The projection spectra ride on every this-many-th report."""
    lambda_poll_seconds: float = 1.0
    """Rank 0's lambda poll period (the agent's default is 5 s, compressed here like the steps)."""
    kill_at: float | None = 0.5
    """When to SIGKILL the last replica, as a fraction of ``duration``; None: never."""
    down_seconds: float = 5.0
    """How long the killed replica stays down before it is restarted."""
    drain_seconds: float | None = None
    """After the load, how long the agents may take to deliver what their spools still hold (None:
    3 x ``duration`` + 60 s, room for a collector that took a third of what was offered)."""
    agent_procs: int = 2
    """Processes the ranks are spread over (their sender threads share one GIL per process)."""
    sample_seconds: float = 1.0
    """How often the sampler reads one run's lambdas from every replica directly."""
    pg_admin_url: str = PG_ADMIN_URL
    haproxy: str = HAPROXY

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"replicas: a fleet needs at least 2, got {self.replicas}")
        if self.ranks < self.ranks_per_run or self.ranks % self.ranks_per_run:
            raise ValueError(f"ranks: {self.ranks} is not a multiple of ranks_per_run={self.ranks_per_run}")
        if self.layers <= max(HOT_LAYERS):
            raise ValueError(f"layers: at least {max(HOT_LAYERS) + 1} (the collapsing layers), got {self.layers}")

    @property
    def drain(self) -> float:
        return self.drain_seconds if self.drain_seconds is not None else 3 * self.duration + 60

    @property
    def runs(self) -> int:
        return self.ranks // self.ranks_per_run

    @property
    def steps(self) -> int:
        return max(1, round(self.duration / self.step_seconds))


# --- synthetic values -------------------------------------------------------------------------


def noise(*key: float) -> float:
    """A deterministic pseudo-random number in [0, 1) of ``key``."""
    x = math.sin(sum((i + 1) * 12.9898 * k for i, k in enumerate(key)) + 78.233) * 43758.5453
    return x - math.floor(x)


def hot(run_index: int) -> bool:
    """Every other run collapses."""
    return run_index % 2 == 0


def crossing(layer: int) -> float:
    """The fraction of the run at which a hot layer's QKAI crosses the threshold (band layers one after another)."""
    return 0.30 + 0.03 * (layer - BAND[0]) if layer in BAND else 0.40


def qkai(run_index: int, layer: int, step: int, steps: int) -> float:
    """Monotone through 0.70 at :func:`crossing` on a hot layer of a collapsing run; 0.25-0.45 elsewhere."""
    if hot(run_index) and layer in HOT_LAYERS:
        t = step / steps
        return min(0.92, max(0.45, THRESHOLD + 0.8 * (t - crossing(layer))))
    return 0.25 + 0.2 * noise(run_index, layer, step, 1)


def attn_entropy(run_index: int, layer: int, step: int, steps: int) -> float:
    """Drifts toward uniform (0.95) with QKAI on a hot layer; 0.70-0.78 elsewhere (lambdas stay low)."""
    base = 0.70 + 0.08 * noise(run_index, layer, step, 2)
    if hot(run_index) and layer in HOT_LAYERS:
        ramp = min(1.0, max(0.0, (step / steps - crossing(layer) + 0.2) / 0.3))
        return base + (0.95 - base) * ramp
    return base


def layer_values(run_index: int, layer: int, step: int, steps: int, spectra: bool) -> dict[str, float]:
    """One layer's metrics of one report."""
    q = qkai(run_index, layer, step, steps)
    out = {
        "qkai": q,
        "qkai_max": min(1.0, q + 0.05),
        "stable_rank": 8.0 + 4.0 * noise(run_index, layer, step, 3),
        "qk_cos": 0.1 + 0.1 * noise(run_index, layer, step, 4),
        "attn_entropy": attn_entropy(run_index, layer, step, steps),
    }
    for i, name in enumerate(ACTIVATION_METRICS):
        out.setdefault(name, 0.5 + noise(run_index, layer, step, 10 + i))
    if spectra:
        for i, name in enumerate(SPECTRA_METRICS):
            out[name] = 10.0 + noise(run_index, layer, step, 30 + i)
    return out


def loss(run_index: int, step: int) -> float:
    return 3.0 / (1.0 + step / 500) + 0.05 * noise(run_index, step, 5)


def expected_alerts(runs: list[str]) -> set[tuple[str, str, tuple[int, ...]]]:
    """(run, rule, layers) of every alert the default rules must raise, once each."""
    out: set[tuple[str, str, tuple[int, ...]]] = set()
    for i, name in enumerate(runs):
        if hot(i):
            out |= {(name, "qkai_high", (layer,)) for layer in HOT_LAYERS}
            out.add((name, "collapse_band", BAND))
    return out


# --- the agents' side --------------------------------------------------------------------------


@dataclass
class RankSpec:
    """One simulated rank: which run, which rank of how many, and how it reaches the collector."""

    run: str
    run_index: int
    rank: int
    world: int
    attempt_key: str
    token: str
    config: dict[str, Any]


class Recorder:
    """What the agents of one process saw: latencies, answers, failures, lambdas (thread-safe enough:
    every update is one ``list.append`` or ``Counter`` increment under the lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posts: list[tuple[float, float]] = []
        """(wall time at the answer, seconds) of each successful POST of reports."""
        self.failed_posts: list[tuple[float, float, str]] = []
        """(wall time, seconds, what) of each failed POST of reports."""
        self.delivery: list[float] = []
        """Seconds from a full report's time to the 2xx that stored it."""
        self.inserted: list[tuple[float, int, int]] = []
        """(wall time, inserted, duplicates) of each successful POST."""
        self.failures: Counter[str] = Counter()
        self.lambdas: list[tuple[str, int, list[Any], str]] = []
        """(run id, version, lambdas, "agent") of each lambda answer a poller got through the balancer."""
        self.other: list[tuple[str, float]] = []
        """(call, seconds) of the other calls (create run, lambdas, status)."""

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "posts": self.posts,
                "failed_posts": self.failed_posts,
                "delivery": self.delivery,
                "inserted": self.inserted,
                "failures": dict(self.failures),
                "lambdas": self.lambdas,
                "other": self.other,
            }


class TimedTransport:
    """The agent's ``HttpTransport``, timed call by call (``qkwatch/agent/transport.py: Transport``)."""

    def __init__(self, inner: Any, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def create_run(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._other("create_run", self.inner.create_run, body)

    def get_lambdas(self, run_id: str) -> dict[str, Any]:
        answer = self._other("get_lambdas", self.inner.get_lambdas, run_id)
        with self.recorder.lock:
            self.recorder.lambdas.append((run_id, int(answer.get("version", -1)), answer.get("lambdas"), "agent"))
        return answer

    def set_status(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._other("set_status", self.inner.set_status, run_id, body)

    def post_reports(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        from qkwatch.agent.transport import TransportError

        start = time.perf_counter()
        try:
            answer: dict[str, Any] = self.inner.post_reports(run_id, body)
        except TransportError as exc:
            what = f"HTTP {exc.status}" if exc.status is not None else _error_kind(exc)
            with self.recorder.lock:
                self.recorder.failed_posts.append((time.time(), time.perf_counter() - start, what))
                self.recorder.failures[what] += 1
            raise
        took = time.perf_counter() - start
        now = time.time()
        with self.recorder.lock:
            self.recorder.posts.append((now, took))
            self.recorder.inserted.append((now, int(answer["inserted"]), int(answer["duplicates"])))
            self.recorder.delivery += [now - r["time"] for r in body["reports"] if r.get("layers")]
        return answer

    def close(self) -> None:
        self.inner.close()

    def _other(self, call: str, fn: Any, *args: Any) -> dict[str, Any]:
        from qkwatch.agent.transport import TransportError

        start = time.perf_counter()
        try:
            answer: dict[str, Any] = fn(*args)
        except TransportError as exc:
            with self.recorder.lock:
                self.recorder.failures[f"{call}: {exc.status or _error_kind(exc)}"] += 1
            raise
        with self.recorder.lock:
            self.recorder.other.append((call, time.perf_counter() - start))
        return answer


def _error_kind(exc: Exception) -> str:
    """The httpx error's class name out of a TransportError's message (``POST /x: ReadError: ...``)."""
    parts = str(exc).split(": ")
    return parts[1] if len(parts) > 2 else "connection"


class SimRank:
    """One rank of a training job, without the model: synthetic values down the agent's real delivery path."""

    def __init__(self, spec: RankSpec, cfg: FleetConfig, url: str, spool_root: Path, recorder: Recorder) -> None:
        from qkwatch.agent.disk_spool import SpoolConfig
        from qkwatch.agent.health import DropNotes, Health
        from qkwatch.agent.identity import RunIdentity
        from qkwatch.agent.lambdas import LambdasConfig, fetch_first
        from qkwatch.agent.shipper import SenderConfig
        from qkwatch.agent.transport import HttpTransport
        from qkwatch.contract.wire import RunConfig

        self.spec, self.cfg = spec, cfg
        self.owned = [layer for layer in range(cfg.layers) if layer % spec.world == spec.rank]
        self.suffix = f"_rank{spec.rank}" if spec.world > 1 else ""
        identity = RunIdentity(PROJECT, spec.run, spec.config, spec.attempt_key, ("fleet",))
        self.spool = SpoolConfig().open(spool_root / PROJECT / spec.run / f"rank-{spec.rank}")
        identity.claim(self.spool, url=url, rank=spec.rank)
        self.health = Health()
        self.drops = DropNotes(self.spool.dropped, self.suffix)
        timeout = 10.0  # AgentConfig.request_timeout's default

        def transports() -> TimedTransport:
            return TimedTransport(HttpTransport(url, spec.token, timeout), recorder)

        self.sender = SenderConfig().build(
            self.spool, transports, health=self.health, name=f"qkwatch-sender-{spec.run}-{spec.rank}"
        )
        self.schedule = RunConfig.model_validate(spec.config).schedule
        self.poller = None
        if spec.rank == 0:
            lambdas_cfg = LambdasConfig(lambda_poll_seconds=cfg.lambda_poll_seconds)
            self.lambdas = lambdas_cfg.build(cfg.layers, self.schedule)
            first = TimedTransport(HttpTransport(url, spec.token, 2.0), recorder)  # the agent's INITIAL_FETCH_SECONDS
            try:
                run_id = fetch_first(first, identity, self.lambdas.offer)
            finally:
                first.close()
            if run_id is not None:
                self.sender.run_id = run_id
            sender = self.sender
            self.poller = lambdas_cfg.poller(lambda: sender.run_id, transports, self.lambdas.offer)
        self.logged: dict[int, dict[str, float]] = {}
        self.logged_at: dict[int, float] = {}
        self.h: dict[int, float] = {}
        """The running entropy of each owned layer, from the values sent (what the collector must hold)."""
        self.points = 0
        self.value_sum = 0.0
        self.frames = 0
        self.reports = 0
        self.sender.start()
        if self.poller is not None:
            self.poller.start()

    def step(self, step: int, now: float) -> None:
        """One training step: rank 0 logs its loss; every ``report_every`` steps a full report."""
        if self.spec.rank == 0:
            self.logged[step] = {"loss": loss(self.spec.run_index, step)}
            self.logged_at[step] = now
        if step % self.cfg.report_every == 0:
            self._report(step, now, main=True)

    def finish(self) -> None:
        """What ``Agent.close`` spools: the logged values left, then rank 0's "finished" status."""
        if self.logged:
            self._report(max(self.logged), time.time(), main=False)
        if self.spec.rank == 0:
            self.spool.append({"attempt_key": self.spec.attempt_key, "status": {"status": "finished"}})
            self.sender.notify()

    def close(self, timeout: float) -> dict[str, Any]:
        """Deliver until ``timeout``; returns what this rank sent and what is left."""
        if self.poller is not None:
            self.poller.close(0.1)
        finished = self.sender.close(timeout)
        pending = self.spool.bytes_pending()
        if finished:
            self.spool.close()
        return {
            "run": self.spec.run,
            "rank": self.spec.rank,
            "points": self.points,
            "value_sum": self.value_sum,
            "frames": self.frames,
            "reports": self.reports,
            "h": {str(k): v for k, v in self.h.items()},
            "pending_bytes": pending,
            "retried": self.health.retried,
            "dead_lettered": self.health.dead_lettered,
        }

    def _report(self, step: int, now: float, *, main: bool) -> None:
        """Pack, encode and spool a report as ``Agent._finish_report`` and ``Agent._write_report`` do."""
        import torch

        from qkwatch.agent.health import health_scalars
        from qkwatch.agent.report import Key, Packed, encode, encode_logged

        keys: list[Key] = []
        values: list[float] = []
        floats: dict[str, float] = {}
        if main:
            spectra = (step // self.cfg.report_every) % self.cfg.spectra_every == 0
            for layer in self.owned:
                for name, v in layer_values(self.spec.run_index, layer, step, self.cfg.steps, spectra).items():
                    keys.append(("layer", name, layer))
                    values.append(v)
            floats.update(self.logged.pop(step, {}))
            self.logged_at.pop(step, None)
            floats.update(
                health_scalars(self.health, spool_bytes=self.spool.bytes_pending(), overhead=0.0, suffix=self.suffix)
            )
            if self.spec.rank == 0:
                floats["lambda_source"] = 0.0 if self.lambdas.source == "collector" else 1.0
                floats["lambda_version"] = float(self.lambdas.version)
        packed = Packed(
            step,
            now,
            keys,
            torch.tensor(values, dtype=torch.float32),
            floats,
            [],
            logged_floats=self.logged,
            logged_times=self.logged_at,
            main=main,
        )
        self.logged, self.logged_at = {}, {}
        for logged in encode_logged(packed):
            self._spool(logged)
        if main:
            report = encode(packed, self.cfg.layers)
            self._spool(report, note_drops=True)
            self._observe(report)

    def _spool(self, report: dict[str, Any], *, note_drops: bool = False) -> None:
        self.spool.make_room(len(json.dumps(report)) + 256)
        if note_drops:
            self.drops.note(report, self.spool.dropped)
        self.spool.append({"attempt_key": self.spec.attempt_key, "report": report})
        self.health.written += 1
        self.sender.notify()
        self.reports += 1
        # encode() leaves finite values as floats (the synthetic values are all finite)
        sent = [v for row in report["layers"].values() for v in row if v is not None]
        sent += list(report["scalars"].values())
        self.points += len(sent)
        self.value_sum += math.fsum(sent)
        self.frames += sum(any(v is not None for v in row) for row in report["layers"].values())

    def _observe(self, report: dict[str, Any]) -> None:
        """The running entropy as the collector computes it (``qkwatch/contract/scheduling.py: ema_update``)."""
        from qkwatch.contract.scheduling import ema_update

        for layer, v in enumerate(report["layers"].get("attn_entropy", ())):
            if isinstance(v, float):
                self.h[layer] = ema_update(self.h.get(layer), v, self.schedule)


def agent_process(plan: Path) -> None:
    """One process of simulated ranks (``python -m bench.fleet --agents PLAN``): attach, say ready,
    wait for the start time, step, close, and write what it saw.

    ``plan`` is a JSON file of ``{"specs", "config", "url", "spool", "out"}``; the process writes
    ``<out>.ready`` once its ranks are attached, waits for ``<out>.go`` (the start time, epoch
    seconds), and writes its results to ``out``.
    """
    job = json.loads(plan.read_text())
    cfg = FleetConfig(**job["config"])
    out = Path(job["out"])
    recorder = Recorder()
    ranks = [SimRank(RankSpec(**s), cfg, job["url"], Path(job["spool"]), recorder) for s in job["specs"]]
    out.with_name(out.name + ".ready.tmp").write_text(str(os.getpid()))
    out.with_name(out.name + ".ready.tmp").rename(out.with_suffix(".ready"))
    go = out.with_suffix(".go")
    while not go.exists():
        time.sleep(0.01)
    t0 = float(go.read_text())
    lag = 0.0
    for step in range(cfg.steps):
        due = t0 + step * cfg.step_seconds
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        now = time.time()
        lag = max(lag, now - due)
        for r in ranks:
            r.step(step, now)
    load_end = time.time()
    for r in ranks:
        r.finish()
    deadline = time.monotonic() + cfg.drain
    results = [r.close(max(0.0, deadline - time.monotonic())) for r in ranks]
    seen = {"ranks": results, "seen": recorder.as_dict(), "lag_max": lag, "load_end": load_end, "drained": time.time()}
    out.write_text(json.dumps(seen))


# --- the servers' side --------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """A new PostgreSQL database (``fleet_<random>``); dropped on the way out."""
    url = sa.make_url(admin_url)
    if url.drivername == "postgresql":  # psycopg 3, the driver the collector uses (whatever SQLAlchemy's default)
        url = url.set(drivername="postgresql+psycopg")
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"fleet_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def haproxy_config(port: int, stats_port: int, replicas: list[int]) -> str:
    """Round robin over the replicas, each health-checked on ``/healthz``; a stats page for the bench."""
    servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check" for i, p in enumerate(replicas))
    return f"""global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-request 30s
    retries 3
    option redispatch

frontend collectors
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk
    http-check send meth GET uri /healthz
    http-check expect status 200
    default-server inter 500ms fastinter 250ms downinter 500ms fall 2 rise 2
{servers}

listen stats
    bind 127.0.0.1:{stats_port}
    stats enable
    stats uri /stats
"""


class Balancer:
    """HAProxy in the foreground on a free loopback port, with its stats page."""

    def __init__(self, binary: str, replicas: list[int], workdir: Path) -> None:
        self.binary = binary
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(haproxy_config(self.port, self.stats_port, replicas))
        self.log = workdir / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Balancer:
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused {self.config}: {check.stdout}{check.stderr}")
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config)], stdout=out, stderr=out)
        self.wait_up(timeout)
        return self

    def servers(self) -> dict[str, dict[str, str]]:
        """The stats page's row of each server (``status``, ``stot``, ``chkdown``, ``downtime``, ...)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "replicas" and r["svname"] not in ("BACKEND",)}

    def wait_up(self, timeout: float, names: list[str] | None = None) -> float:
        """Wait until the servers (all, or ``names``) are UP in HAProxy's eyes; returns when (wall time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                rows = self.servers()
                if rows and all(r["status"] == "UP" for n, r in rows.items() if names is None or n in names):
                    return time.time()
            time.sleep(0.1)
        raise RuntimeError(f"haproxy: servers not UP after {timeout:g} s")

    def wait_down(self, name: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if self.servers()[name]["status"].startswith("DOWN"):
                    return time.time()
            time.sleep(0.05)
        return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def cpu_seconds(pids: set[int] | None = None, group: int | None = None) -> dict[int, float]:
    """User + system CPU seconds of live processes, by pid: those in ``pids``, or of process ``group``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (pids is not None and int(entry.name) not in pids):
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if group is None or int(fields[2]) == group:  # fields after the name: state, ppid, pgrp, ...
            out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


class Sampler:
    """Reads one run's lambdas from every replica directly (not through the balancer), round robin over
    runs; and the CPU time of the replicas' processes and of the database's server processes."""

    def __init__(self, replicas: list[CollectorProcess], token: str, period: float, engine: sa.Engine) -> None:
        self.replicas, self.token, self.period, self.engine = replicas, token, period, engine
        self.seen: list[tuple[str, int, list[Any], str]] = []
        self.failures = 0
        self.collector_cpu: dict[int, float] = {}
        """Last CPU seconds seen of each replica process (a killed one's stay as last seen)."""
        self.database_cpu: dict[int, float] = {}
        """The same of each PostgreSQL backend serving the fleet's database."""
        self.baseline: dict[int, float] = {}
        """CPU seconds of each process before it carried load (start-up, migrations): not counted."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def measure_cpu(self) -> None:
        """Note the CPU time of every replica process and database backend now."""
        for replica in self.replicas:
            proc = replica.proc
            if proc is not None and proc.poll() is None:
                self.collector_cpu.update(cpu_seconds(group=proc.pid))
        with self.engine.connect() as conn:
            backends = conn.execute(
                sa.text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
            ).scalars()
            self.database_cpu.update(cpu_seconds(set(backends)))

    def mark_baseline(self, replica: CollectorProcess | None = None) -> None:
        """Note the CPU time spent so far by every process, or by ``replica``'s (just started)."""
        self.measure_cpu()
        if replica is None:
            self.baseline.update(self.collector_cpu | self.database_cpu)
        elif replica.proc is not None:
            self.baseline.update(cpu_seconds(group=replica.proc.pid))

    def load_cpu(self) -> dict[str, float]:
        """CPU seconds of the replicas and of the database backends since their baselines."""
        return {
            name: sum(max(0.0, s - self.baseline.get(pid, 0.0)) for pid, s in seen.items())
            for name, seen in (("collector", self.collector_cpu), ("database", self.database_cpu))
        }

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        turn = 0
        with httpx.Client(headers=headers, timeout=10) as http:
            while not self._stop.wait(self.period):
                self.measure_cpu()
                with self.engine.connect() as conn:
                    ids = conn.execute(sa.text("SELECT id FROM runs ORDER BY name")).scalars().all()
                if not ids:
                    continue
                run_id = ids[turn % len(ids)]
                turn += 1
                for i, replica in enumerate(self.replicas):
                    try:
                        answer = http.get(f"{replica.url}/v1/runs/{run_id}/lambdas").raise_for_status().json()
                    except httpx.HTTPError:
                        self.failures += 1  # the killed replica, while it is down
                        continue
                    self.seen.append((run_id, int(answer["version"]), answer["lambdas"], f"replica {i}"))


# --- one session -----------------------------------------------------------------------------------


def run_fleet(cfg: FleetConfig, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Build the fleet, load it for ``cfg.duration`` s with a kill -9 midway, check and measure; returns the figures."""
    from qkwatch.contract.wire import RunConfig
    from qkwatch.monitor.store.engine import make_engine
    from qkwatch.monitor.store.migrate import upgrade
    from qkwatch.monitor.store.store import Store

    workdir.mkdir(parents=True, exist_ok=True)
    with fresh_database(cfg.pg_admin_url) as url:
        engine = make_engine(url)
        upgrade(engine)
        store = Store(make_engine(url))
        names = [f"run-{i:03d}" for i in range(cfg.runs)]
        config = {"n_layers": cfg.layers}
        # the schedule is sent in full, as the agent does
        config["schedule"] = dataclasses.asdict(RunConfig.model_validate(config).schedule)
        tokens = {n: store.create_token(PROJECT, ["ingest", "read"], name=n)[1] for n in names}
        reader = store.create_token(PROJECT, ["read"], name="fleet-checks")[1]
        store.close()
        keys = {n: uuid.uuid4().hex for n in names}  # one attempt key per run, shared by its ranks
        specs = [
            RankSpec(n, i, r, cfg.ranks_per_run, keys[n], tokens[n], config)
            for i, n in enumerate(names)
            for r in range(cfg.ranks_per_run)
        ]
        replicas = [
            CollectorProcess(
                url,
                log=workdir / f"replica-{i}.log",
                open_access=False,
                args=["--workers", str(cfg.workers)],
                cwd=ROOT,
                own_group=True,
                start_timeout=120,
            )
            for i in range(cfg.replicas)
        ]
        balancer = Balancer(cfg.haproxy, [r.port for r in replicas], workdir)
        try:
            _start_all(replicas)
            balancer.start()
            log(f"fleet: {cfg.replicas} replicas x {cfg.workers} workers, haproxy {balancer.url}, {cfg.ranks} ranks")
            before = balancer.servers()
            sampler = Sampler(replicas, reader, cfg.sample_seconds, engine)
            outcome = _load(cfg, specs, balancer, replicas, sampler, workdir, log)
            after = balancer.servers()
            outcome["probe"] = _probe(balancer)
            results = _collect(workdir, cfg.agent_procs)
            return _summarize(cfg, names, results, outcome, engine, replicas, reader, before, after)
        finally:
            balancer.stop()
            for r in replicas:
                r.stop()
            engine.dispose()


def _probe(balancer: Balancer, n: int = 20) -> dict[str, int]:
    """After the load: ``n`` requests through the balancer, each on a new connection; how many each
    replica answered (the restarted one is back in the rotation when it has some)."""
    before = balancer.servers()
    for _ in range(n):
        httpx.get(f"{balancer.url}/healthz", timeout=10).raise_for_status()
    after = balancer.servers()
    return {name: int(row["stot"] or 0) - int(before[name]["stot"] or 0) for name, row in after.items()}


def _start_all(replicas: list[CollectorProcess]) -> None:
    """Start the replicas side by side (each migrates under PostgreSQL's advisory lock, then serves)."""
    errors: list[BaseException] = []

    def start(r: CollectorProcess) -> None:
        try:
            r.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _load(
    cfg: FleetConfig,
    specs: list[RankSpec],
    balancer: Balancer,
    replicas: list[CollectorProcess],
    sampler: Sampler,
    workdir: Path,
    log: Any,
) -> dict[str, Any]:
    """Start the agent processes, run the load with the kill, wait for them; returns the kill's timeline."""
    procs = _start_agents(cfg, specs, balancer.url, workdir)
    try:
        sampler.mark_baseline()
        t0 = time.time() + 0.5
        for p in range(cfg.agent_procs):  # written whole, then renamed: the agents poll for it
            go = workdir / f"agents-{p}.go"
            go.with_suffix(".tmp").write_text(repr(t0))
            go.with_suffix(".tmp").rename(go)
        sampler.start()
        outcome: dict[str, Any] = {"t0": t0, "end": t0 + cfg.duration}
        if cfg.kill_at is not None:
            time.sleep(max(0.0, t0 + cfg.kill_at * cfg.duration - time.time()))
            outcome.update(_kill_and_restart(cfg, replicas, balancer, sampler, t0, log))
        time.sleep(max(0.0, t0 + cfg.duration - time.time()))
        log("fleet: load over, draining the spools")
        for p, proc in enumerate(procs):
            code = proc.wait(cfg.drain + 120)
            if code != 0:
                raise RuntimeError(f"agent process {p} exited with {code}: see {workdir}/agents-{p}.log")
    finally:
        for proc in procs:  # only those still running: an error above
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    sampler.close()
    sampler.measure_cpu()
    outcome["cpu_s"] = sampler.load_cpu()
    outcome["sampled"] = sampler.seen
    outcome["sample_failures"] = sampler.failures
    return outcome


def _start_agents(cfg: FleetConfig, specs: list[RankSpec], url: str, workdir: Path) -> list[subprocess.Popen[bytes]]:
    """The agent processes (``python -m bench.fleet --agents PLAN``), each with its share of the ranks,
    attached and waiting for their start time."""
    procs = []
    for p in range(cfg.agent_procs):
        out = workdir / f"agents-{p}.json"
        plan = workdir / f"agents-{p}.plan.json"
        job = {
            "specs": [dataclasses.asdict(s) for s in specs[p :: cfg.agent_procs]],
            "config": dataclasses.asdict(cfg),
            "url": url,
            "spool": str(workdir / "spool"),
            "out": str(out),
        }
        plan.write_text(json.dumps(job))
        with (workdir / f"agents-{p}.log").open("a") as log_file:
            cmd = [sys.executable, "-m", "bench.fleet", "--agents", str(plan)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 300
    while not all((workdir / f"agents-{p}.ready").exists() for p in range(cfg.agent_procs)):
        if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"the agent processes did not start: see {workdir}/agents-*.log")
        time.sleep(0.05)
    return procs


def _kill_and_restart(
    cfg: FleetConfig,
    replicas: list[CollectorProcess],
    balancer: Balancer,
    sampler: Sampler,
    t0: float,
    log: Any,
) -> dict[str, Any]:
    """SIGKILL the last replica (supervisor and workers), restart it after ``down_seconds``; the timeline."""
    victim, name = replicas[-1], f"r{len(replicas) - 1}"
    sampler.measure_cpu()  # the victim's CPU time, as close to its end as can be
    out: dict[str, Any] = {"killed_at": time.time()}
    victim.stop(hard=True)  # SIGKILL to its process group
    log(f"fleet: kill -9 replica {name} at {out['killed_at'] - t0:.1f} s")
    out["seen_down_at"] = balancer.wait_down(name, cfg.down_seconds + 5)
    time.sleep(max(0.0, out["killed_at"] + cfg.down_seconds - time.time()))
    victim.start()
    sampler.mark_baseline(victim)  # its start-up is not load
    out["restarted_at"] = time.time()
    out["seen_up_at"] = balancer.wait_up(60, [name])
    back, up = out["restarted_at"] - t0, out["seen_up_at"] - t0
    log(f"fleet: replica {name} back at {back:.1f} s, UP in haproxy at {up:.1f} s")
    out["stats_at_restart"] = balancer.servers()
    return out


def _collect(workdir: Path, procs: int) -> dict[str, Any]:
    merged: dict[str, Any] = {"ranks": [], "seen": defaultdict(list), "failures": Counter(), "lag_max": 0.0}
    for p in range(procs):
        part = json.loads((workdir / f"agents-{p}.json").read_text())
        merged["ranks"] += part["ranks"]
        for key, value in part["seen"].items():
            if key == "failures":
                merged["failures"].update(value)
            else:
                merged["seen"][key] += value
        merged["lag_max"] = max(merged["lag_max"], part["lag_max"])
        merged["load_end"] = max(merged.get("load_end", 0.0), part["load_end"])
        merged["drained"] = max(merged.get("drained", 0.0), part["drained"])
    return merged


# --- checks and figures --------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p99 and max in milliseconds (None when there are no values)."""
    if not values:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "n": 0}
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 99
    return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "max_ms": ordered[-1] * 1e3, "n": len(ordered)}


def _summarize(
    cfg: FleetConfig,
    names: list[str],
    results: dict[str, Any],
    outcome: dict[str, Any],
    engine: sa.Engine,
    replicas: list[CollectorProcess],
    reader: str,
    before: dict[str, dict[str, str]],
    after: dict[str, dict[str, str]],
) -> dict[str, Any]:
    seen = results["seen"]
    t0, end = outcome["t0"], outcome["end"]
    with engine.connect() as conn:
        stored = _stored(conn)
        alerts = _alerts(conn)
        sizes = _sizes(conn)
        run_ids = dict(conn.execute(sa.text("SELECT name, id FROM runs")).all())
        statuses = dict(conn.execute(sa.text("SELECT name, status FROM runs")).all())
    points = _points(results["ranks"], stored)
    lambdas = _lambdas(cfg, results["ranks"], replicas, reader, run_ids, seen["lambdas"] + outcome["sampled"])
    rest_alerts = _rest_alerts(replicas, reader)
    want = expected_alerts(names)
    got = Counter((a["run"], a["rule"], tuple(a["layers"])) for a in alerts)
    last_ack = max((t for t, _n, _d in seen["inserted"]), default=end)
    kill = {
        k: (v - t0 if isinstance(v, float) else v)
        for k, v in outcome.items()
        if k.endswith("_at") and k != "stats_at_restart"
    }
    victim = f"r{cfg.replicas - 1}"
    served_after = (
        int(after[victim]["stot"]) - int(outcome["stats_at_restart"][victim]["stot"])
        if "stats_at_restart" in outcome
        else None
    )
    return {
        "config": dataclasses.asdict(cfg),
        "runs": len(names),
        "points": points,
        "alerts": {
            "expected": len(want),
            "raised": sum(got.values()),
            "missing": sorted(map(list, want - set(got))),
            "unexpected": sorted(map(list, set(got) - want)),
            "more_than_once": sorted([[*k, n] for k, n in got.items() if n > 1]),
            "notifications_firing_per_alert": sorted({a["firing_notifications"] for a in alerts}),
            "states": dict(Counter(a["state"] for a in alerts)),
            "rest_equal_on_every_replica": all(x == rest_alerts[0] for x in rest_alerts),
            "rest_count": [len(x) for x in rest_alerts],
        },
        "lambdas": lambdas,
        "latency": {
            "post": percentiles([d for _t, d in seen["posts"]]),
            "post_outside_kill": percentiles([d for t, d in seen["posts"] if not _in_kill_window(t, outcome)]),
            "delivery": percentiles(seen["delivery"]),
            "other": {
                call: percentiles([d for c, d in seen["other"] if c == call])
                for call in sorted({c for c, _d in seen["other"]})
            },
        },
        "posts": {
            "ok": len(seen["posts"]),
            "failed": dict(results["failures"]),
            "replayed_points": sum(d for _t, _n, d in seen["inserted"]),
        },
        "rates": {
            "offered_points_per_s": _offered(cfg),
            "sent_points_per_s": points["sent"] / (results["load_end"] - t0),
            "stored_points_per_s": points["stored"] / (last_ack - t0),
            "points_per_post": sum(n + d for _t, n, d in seen["inserted"]) / max(1, len(seen["inserted"])),
            "drain_s": last_ack - results["load_end"],
            "producer_lag_max_s": results["lag_max"],
        },
        "kill": {
            **kill,
            "replica": victim,
            "requests_served_after_restart": served_after,
            "probe_after_the_load": outcome["probe"],
            "haproxy_chkdown": {n: int(r["chkdown"] or 0) for n, r in after.items()},
            "haproxy_requests": {n: int(r["stot"] or 0) - int(before[n]["stot"] or 0) for n, r in after.items()},
            "sampler_failures": outcome["sample_failures"],
        },
        "cpu": {
            **outcome["cpu_s"],
            "points_per_collector_cpu_s": points["stored"] / max(outcome["cpu_s"]["collector"], 1e-9),
            "points_per_database_cpu_s": points["stored"] / max(outcome["cpu_s"]["database"], 1e-9),
        },
        "statuses": dict(Counter(statuses.values())),
        "sizes": sizes,
    }


def _in_kill_window(t: float, outcome: dict[str, Any]) -> bool:
    """From the kill until 10 s after HAProxy saw the replica up again."""
    start = outcome.get("killed_at")
    return start is not None and start <= t <= (outcome.get("seen_up_at") or start) + 10.0


def _offered(cfg: FleetConfig) -> float:
    """Points per second the ranks send: owned layers x metrics per report, scalars, and rank 0's losses."""
    per_layer = len(WEIGHT_METRICS) + len(ACTIVATION_METRICS) + len(SPECTRA_METRICS) / cfg.spectra_every
    layer_points = cfg.layers * per_layer  # over the ranks of one run
    scalars = (
        7 * cfg.ranks_per_run + 2
    )  # each rank's agent_* (with agent_dropped_total), rank 0's lambda_source/version
    per_run = (layer_points + scalars) / (cfg.report_every * cfg.step_seconds) + 1 / cfg.step_seconds  # + the loss
    return per_run * cfg.runs


def _stored(conn: sa.Connection) -> dict[str, dict[str, float]]:
    rows = conn.execute(
        sa.text(
            "SELECT r.name, count(*), sum(p.value), count(DISTINCT (p.metric_id, p.head, p.layer, p.step, p.attempt)) "
            "FROM points p JOIN runs r ON r.pk = p.run_pk GROUP BY r.name"
        )
    ).all()
    frames = dict(
        conn.execute(
            sa.text("SELECT r.name, count(*) FROM frames f JOIN runs r ON r.pk = f.run_pk GROUP BY r.name")
        ).all()
    )
    return {
        name: {"points": n, "sum": float(total or 0.0), "distinct": distinct, "frames": frames.get(name, 0)}
        for name, n, total, distinct in rows
    }


def _points(ranks: list[dict[str, Any]], stored: dict[str, dict[str, float]]) -> dict[str, Any]:
    sent: dict[str, dict[str, float]] = defaultdict(lambda: {"points": 0, "sum": 0.0, "frames": 0})
    for r in ranks:
        sent[r["run"]]["points"] += r["points"]
        sent[r["run"]]["sum"] += r["value_sum"]
        sent[r["run"]]["frames"] += r["frames"]
    lost = sum(max(0, s["points"] - stored.get(run, {}).get("points", 0)) for run, s in sent.items())
    extra = sum(max(0, st["points"] - sent.get(run, {}).get("points", 0)) for run, st in stored.items())
    sums_differ = [
        run
        for run, s in sent.items()
        if not math.isclose(s["sum"], stored.get(run, {}).get("sum", 0.0), rel_tol=1e-9, abs_tol=1e-6)
    ]
    return {
        "sent": sum(s["points"] for s in sent.values()),
        "stored": sum(st["points"] for st in stored.values()),
        "lost": lost,
        "duplicated": extra + sum(st["points"] - st["distinct"] for st in stored.values()),
        "runs_whose_value_sums_differ": sums_differ,
        "frames_sent": sum(s["frames"] for s in sent.values()),
        "frames_stored": sum(st["frames"] for st in stored.values()),
        "pending_bytes_left": sum(r["pending_bytes"] for r in ranks),
        "dead_lettered": sum(r["dead_lettered"] for r in ranks),
        "agent_retries": sum(r["retried"] for r in ranks),
    }


def _alerts(conn: sa.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.text(
            "SELECT r.name, a.id, a.rule, a.layers, a.state, "
            "(SELECT count(*) FROM alert_notifications n WHERE n.alert_id = a.id AND n.status = 'firing') "
            "FROM alerts a JOIN runs r ON r.pk = a.run_pk ORDER BY a.id"
        )
    ).all()
    return [
        {"run": n, "id": i, "rule": rule, "layers": json.loads(layers), "state": state, "firing_notifications": f}
        for n, i, rule, layers, state, f in rows
    ]


def _rest_alerts(replicas: list[CollectorProcess], token: str) -> list[list[tuple[Any, ...]]]:
    """``GET /v1/alerts`` from every replica directly: (id, run, rule, layers, state, onset) of each."""
    out = []
    for replica in replicas:
        with replica.client(token) as c:
            out.append(sorted((a.id, a.run_name, a.rule, tuple(a.layers), a.state, a.onset_step) for a in c.alerts()))
    return out


def _lambdas(
    cfg: FleetConfig,
    ranks: list[dict[str, Any]],
    replicas: list[CollectorProcess],
    token: str,
    run_ids: dict[str, str],
    observed: list[tuple[str, int, list[Any], str]],
) -> dict[str, Any]:
    """Every replica's lambdas of every run, read directly, against each other and against the EMA of what was sent."""
    from qkwatch.contract.scheduling import ScheduleConfig, entropy_floor

    h: dict[str, dict[int, float]] = defaultdict(dict)
    for r in ranks:
        h[r["run"]].update({int(k): v for k, v in r["h"].items()})
    differ, wrong = [], []
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=headers, timeout=30) as http:
        for name, run_id in sorted(run_ids.items()):
            answers = [http.get(f"{r.url}/v1/runs/{run_id}/lambdas").raise_for_status().json() for r in replicas]
            if any(a != answers[0] for a in answers):
                differ.append(name)
            schedule = ScheduleConfig(**answers[0]["schedule"])
            expect = entropy_floor([h[name].get(layer) for layer in range(cfg.layers)], schedule)
            served = answers[0]["lambdas"]
            if len(served) != len(expect) or not all(
                math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(served, expect, strict=True)
            ):
                wrong.append(name)
    by_version: dict[tuple[str, int], set[str]] = defaultdict(set)
    for run_id, version, values, _who in observed:
        by_version[(run_id, version)].add(json.dumps(values))
    split = sorted(f"{run}@{version}" for (run, version), v in by_version.items() if len(v) > 1)
    return {
        "runs_whose_replicas_differ": differ,
        "runs_not_the_ema_of_what_was_sent": wrong,
        "answers_observed": len(observed),
        "versions_observed": len(by_version),
        "versions_with_two_answers": split,
    }


def _sizes(conn: sa.Connection) -> dict[str, Any]:
    """Bytes on disk per table (heap, indexes, TOAST) and per row, after the session."""
    conn.execute(sa.text("ANALYZE"))
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, pg_total_relation_size(c.oid), pg_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
        )
    ).all()
    tables = {}
    for name, total, heap in rows:
        count = conn.execute(sa.text(f'SELECT count(*) FROM "{name}"')).scalar_one()
        tables[name] = {
            "rows": count,
            "bytes": total,
            "heap_bytes": heap,
            "bytes_per_row": total / count if count else None,
        }
    points = tables["points"]["rows"] or 1
    database = conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar_one()
    return {
        "tables": tables,
        "database_bytes": database,
        "all_tables_bytes_per_point": sum(t["bytes"] for t in tables.values()) / points,
    }


def problems(result: dict[str, Any]) -> list[str]:
    """What the session got wrong (empty: nothing lost or doubled, alerts once, lambdas agree)."""
    out = []
    p, a, la = result["points"], result["alerts"], result["lambdas"]
    if p["lost"] or p["duplicated"] or p["sent"] != p["stored"]:
        out.append(f"points: sent {p['sent']}, stored {p['stored']}, lost {p['lost']}, duplicated {p['duplicated']}")
    if p["runs_whose_value_sums_differ"]:
        out.append(f"points: stored values differ from those sent in {p['runs_whose_value_sums_differ']}")
    if p["frames_sent"] != p["frames_stored"]:
        out.append(f"frames: sent {p['frames_sent']}, stored {p['frames_stored']}")
    if p["pending_bytes_left"] or p["dead_lettered"]:
        out.append(f"spools: {p['pending_bytes_left']} bytes undelivered, {p['dead_lettered']} reports dead-lettered")
    if a["missing"] or a["unexpected"] or a["more_than_once"]:
        out.append(
            f"alerts: missing {a['missing']}, unexpected {a['unexpected']}, more than once {a['more_than_once']}"
        )
    if a["notifications_firing_per_alert"] not in ([], [1]):
        out.append(f"alerts: firing notifications per alert {a['notifications_firing_per_alert']}")
    if result["statuses"] == {"finished": result["runs"]} and a["states"] not in ({}, {"ended": a["raised"]}):
        out.append(f"alerts: every run finished while its alerts fired, yet their states are {a['states']}")
    if not a["rest_equal_on_every_replica"]:
        out.append("alerts: the replicas' GET /v1/alerts differ")
    if la["runs_whose_replicas_differ"] or la["runs_not_the_ema_of_what_was_sent"] or la["versions_with_two_answers"]:
        out.append(f"lambdas: {la}")
    return out


# --- the command ----------------------------------------------------------------------------------


def plot(sessions: list[dict[str, Any]], path: Path, note: str = "") -> None:
    """p99 latency and points/s against the number of ranks (plotly, PNG through kaleido)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ranks = [s["config"]["ranks"] for s in sessions]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p99 latency at the agents", "points per second"))
    for key, label, dash in (("post", "POST of a batch", "solid"), ("delivery", "report to stored", "dot")):
        ys = [s["latency"][key]["p99_ms"] for s in sessions]
        fig.add_trace(go.Scatter(x=ranks, y=ys, name=f"p99 {label}", mode="lines+markers", line={"dash": dash}), 1, 1)
    for key, label, dash in (
        ("stored_points_per_s", "stored", "solid"),
        ("sent_points_per_s", "sent by the agents", "dot"),
        ("offered_points_per_s", "offered (the nominal cadence)", "dash"),
    ):
        ys = [s["rates"][key] for s in sessions]
        fig.add_trace(go.Scatter(x=ranks, y=ys, name=label, mode="lines+markers", line={"dash": dash}), 1, 2)
    for col in (1, 2):
        fig.update_xaxes(title_text="simulated ranks", type="log", tickvals=ranks, row=1, col=col)
    fig.update_yaxes(title_text="ms", type="log", row=1, col=1)
    fig.update_yaxes(title_text="points/s", row=1, col=2)
    c = sessions[0]["config"]
    fig.update_layout(
        title=f"qkwatch fleet: {c['replicas']} replicas x {c['workers']} workers, HAProxy, one PostgreSQL "
        f"({c['duration']:g} s of load per point, kill -9 of one replica midway){note and '<br>' + note}",
        width=1100,
        height=480,
        margin={"t": 110},
    )
    os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
    fig.write_image(path, scale=1)


def table(sessions: list[dict[str, Any]]) -> str:
    """The results as markdown tables: load and correctness, then the kill and the CPU time."""
    lines = [
        "| ranks | runs | POST p50 / p99 / max ms | delivery p50 / p99 / max ms | pts/s offered / sent / stored "
        "| pts per POST | sent = stored | lost | dup | alerts (expected) | lambdas equal |",
        "|---:|---:|---|---|---|---:|---|---:|---:|---|---|",
    ]
    for s in sessions:
        p, d = s["latency"]["post"], s["latency"]["delivery"]
        pts, al, la, r = s["points"], s["alerts"], s["lambdas"], s["rates"]
        equal = not (
            la["runs_whose_replicas_differ"]
            or la["versions_with_two_answers"]
            or la["runs_not_the_ema_of_what_was_sent"]
        )
        lines.append(
            f"| {s['config']['ranks']} | {s['runs']} | {_ms(p)} | {_ms(d)} | {r['offered_points_per_s']:,.0f} / "
            f"{r['sent_points_per_s']:,.0f} / {r['stored_points_per_s']:,.0f} | {r['points_per_post']:,.0f} "
            f"| {pts['sent']:,} = {pts['stored']:,} | {pts['lost']} | {pts['duplicated']} "
            f"| {al['raised']} ({al['expected']}) | {'yes' if equal else 'NO'} |"
        )
    lines += [
        "",
        "| ranks | killed at s | HAProxy saw it down at s | restarted, UP in HAProxy at s | requests to it after "
        "| failed calls (retried) | replayed pts | drain s | agents' lag s | collector CPU s | PG CPU s "
        "| pts per collector CPU-s | pts per PG CPU-s |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sessions:
        k, c, r = s["kill"], s["cpu"], s["rates"]
        failed = ", ".join(f"{n} {what}" for what, n in sorted(s["posts"]["failed"].items())) or "0"
        lines.append(
            f"| {s['config']['ranks']} | {_s(k.get('killed_at'))} | {_s(k.get('seen_down_at'))} "
            f"| {_s(k.get('seen_up_at'))} | {k['requests_served_after_restart']} | {failed} "
            f"| {s['posts']['replayed_points']:,} | {r['drain_s']:.1f} | {r['producer_lag_max_s']:.1f} "
            f"| {c['collector']:.0f} | {c['database']:.0f} | {c['points_per_collector_cpu_s']:,.0f} "
            f"| {c['points_per_database_cpu_s']:,.0f} |"
        )
    return "\n".join(lines)


P99_GOAL_MS = 250.0
"""Issue 33's goal: POST p99 under this at 16 ranks."""
RANKS_PLANNED = 10_000


def goals(sessions: list[dict[str, Any]]) -> str:
    """Each session's POST p99 beside the goal, its points per collector CPU-second and, from that
    figure, the collector cores that 10,000 ranks at this cadence would need."""
    lines = []
    for s in sessions:
        ranks, p99 = s["config"]["ranks"], s["latency"]["post"]["p99_ms"]
        per_cpu = s["cpu"]["points_per_collector_cpu_s"]
        per_rank = s["rates"]["offered_points_per_s"] / ranks
        verdict = "-" if p99 is None else ("met" if p99 < P99_GOAL_MS else "not met")
        cores = RANKS_PLANNED * per_rank / per_cpu if per_cpu else float("nan")
        lines.append(
            f"{ranks} ranks: POST p99 {p99:,.0f} ms (goal < {P99_GOAL_MS:.0f} ms at 16 ranks: {verdict}); "
            f"{per_cpu:,.0f} points per collector CPU-second; {RANKS_PLANNED:,} ranks at {per_rank:,.0f} points/s "
            f"each = {RANKS_PLANNED * per_rank:,.0f} points/s = {cores:,.0f} collector cores at that rate"
        )
    return "\n".join(lines)


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def _ms(p: dict[str, Any]) -> str:
    return " / ".join("-" if p[k] is None else f"{p[k]:,.0f}" for k in ("p50_ms", "p99_ms", "max_ms"))


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
