"""One fleet session: build the database, the replicas and the balancer, start the agent processes, load,
kill one replica with SIGKILL and restart it, collect what the agents saw and summarize.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from bench.fleet.agents import RankSpec
from bench.fleet.checks import summarize
from bench.fleet.config import (
    PROJECT,
    ROOT,
    FleetConfig,
)
from bench.fleet.sampler import Sampler
from bench.fleet.servers import Balancer, fresh_database
from qkwatch.launch import CollectorProcess


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
            return summarize(cfg, names, results, outcome, engine, replicas, reader, before, after)
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
