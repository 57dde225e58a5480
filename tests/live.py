"""A real ``qkwatch serve`` in a subprocess, on a fixed loopback port, that tests can stop and restart.

Used by the agent, trainer and end-to-end tests: the collector keeps its SQLite file across
restarts (an outage, not a wipe), and the database is read back through ``monitor.client.Client``
or directly with SQLAlchemy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from monitor.client import Client

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveCollector:
    """``qkwatch serve --open`` on 127.0.0.1:<port> over a SQLite file; ``stop()`` and ``start()`` at will.

    Tests get one from the ``collector`` fixture (tests/conftest.py), which stops it even when
    the test fails.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *extra: str,
        env: dict[str, str] | None = None,
        open_access: bool = True,
    ):
        """``extra``: more ``serve`` arguments; ``env``: settings as ``QKWATCH_*`` variables (e.g. the
        body and rate limits); ``open_access=False`` requires tokens (``token()`` mints them)."""
        self.db_url = f"sqlite:///{workdir / 'collector.db'}"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.env = dict(env or {})
        self.open_access = open_access
        self.log = workdir / "collector.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> LiveCollector:
        assert self.proc is None, "already running"
        command = [
            sys.executable,
            "-m",
            "qkwatch.cli",
            "serve",
            *(["--open"] if self.open_access else []),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--database-url",
            self.db_url,
            *self.extra,
        ]
        with open(self.log, "a") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"qkwatch serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"qkwatch serve did not become healthy:\n{self.log.read_text()[-3000:]}")

    def stop(self, hard: bool = False) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL if hard else signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.proc = None

    def client(self, token: str | None = None) -> Client:
        return Client(self.url, token=token)

    def token(self, *scopes: str, project: str = "tests") -> str:
        """A new token with ``scopes`` on this collector's database, minted by ``qkwatch token create``."""
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "qkwatch.cli",
                "token",
                "create",
                "--project",
                project,
                *(arg for scope in scopes for arg in ("--scope", scope)),
                "--database-url",
                self.db_url,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[0]

    def __enter__(self) -> LiveCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BlackHole:
    """A TCP server that accepts connections and never answers (a hung collector)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
