"""The agents' side of the fleet: simulated ranks down the agent's real delivery path (spool, sender,
timed transport, lambda poller), and one process of them (``python -m bench.fleet --agents PLAN``).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet.config import (
    PROJECT,
    FleetConfig,
)
from bench.fleet.values import layer_values, loss


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
    """The agent's ``HttpTransport``, timed call by call (``qkwatch/agent/shipping/transport.py: Transport``)."""

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
        from qkwatch.agent.shipping.transport import TransportError

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
        from qkwatch.agent.shipping.transport import TransportError

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
        from qkwatch.agent.health import DropNotes, Health
        from qkwatch.agent.identity import RunIdentity
        from qkwatch.agent.lambdas.lambdas import LambdasConfig
        from qkwatch.agent.lambdas.poller import fetch_first
        from qkwatch.agent.shipping.disk_spool import SpoolConfig
        from qkwatch.agent.shipping.shipper import SenderConfig
        from qkwatch.agent.shipping.transport import HttpTransport
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
