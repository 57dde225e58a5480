"""What the fleet samples while it runs: every replica's lambdas read directly, and the CPU time of the
replicas' and of the database's processes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from qkwatch.launch import CollectorProcess


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
