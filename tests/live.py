"""A real ``qkwatch serve`` in a subprocess, on a fixed loopback port, that tests can stop and restart.

Used by the agent, trainer and end-to-end tests: the collector keeps its SQLite file across
restarts (an outage, not a wipe), and the database is read back through ``qkwatch.client.Client``
or directly with SQLAlchemy. The process itself is ``qkwatch.launch.CollectorProcess``, which the
demo and the benchmarks use too.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

from qkwatch.launch import CollectorProcess, free_port

__all__ = ["ROOT", "BlackHole", "LiveCollector", "free_port"]

ROOT = Path(__file__).resolve().parents[1]


class LiveCollector(CollectorProcess):
    """``qkwatch serve --open`` on 127.0.0.1:<port> over ``<workdir>/collector.db``; ``stop()`` and ``start()``
    at will. Its output goes to ``<workdir>/collector.log``.

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
        super().__init__(
            f"sqlite:///{workdir / 'collector.db'}",
            port=port,
            log=workdir / "collector.log",
            open_access=open_access,
            args=extra,
            env=env,
            cwd=ROOT,
        )

    @property
    def db_url(self) -> str:
        return self.database_url

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
