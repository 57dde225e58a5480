"""The servers' side of the fleet: a fresh PostgreSQL database, and HAProxy in front of the replicas."""

from __future__ import annotations

import contextlib
import csv
import io
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import sqlalchemy as sa

from qkwatch.launch import free_port


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
