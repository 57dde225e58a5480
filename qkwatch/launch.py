"""A collector in a subprocess: ``qkwatch serve`` on a loopback port, started and waited for.

One helper for everything that runs a real collector beside itself: ``qkwatch demo``, the tests'
``LiveCollector`` (tests/live.py) and the benchmarks (bench/)::

    from qkwatch.launch import CollectorProcess

    with CollectorProcess("sqlite:///demo.db", log="collector.log") as collector:  # healthy here
        with collector.client() as client:
            client.health()
    # stopped (SIGTERM) here

``start()`` returns once ``GET /healthz`` answers 200 and raises :class:`CollectorLaunchError`, with
the end of the collector's log, if the process exits or stays unhealthy; ``stop()`` and ``start()``
again restart it on the same port over the same database (an outage, not a wipe).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from qkwatch.client.rest import Client

HOST = "127.0.0.1"
LOG_TAIL_CHARS = 3000
"""How much of the collector's log a :class:`CollectorLaunchError` quotes."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


def port_is_free(port: int) -> bool:
    """Whether ``qkwatch serve`` could listen on ``127.0.0.1:port`` now.

    The probe binds as uvicorn does, with ``SO_REUSEADDR``: a port whose last connections linger in
    TIME_WAIT (a collector that just stopped) is free, one that a server listens on is not.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def first_free_port(start: int, tries: int = 100) -> int:
    """``start`` if it is free, else the first free port of the ``tries`` after it, else any free one."""
    return next((port for port in range(start, start + tries) if port_is_free(port)), None) or free_port()


class CollectorLaunchError(RuntimeError):
    """``qkwatch serve`` exited, or did not answer ``/healthz`` in time; the message ends with its log."""


class CollectorProcess:
    """``qkwatch serve`` on ``127.0.0.1:<port>`` in a subprocess; a context manager that starts and stops it.

    Args:
        database_url: the collector's SQLAlchemy URL (``--database-url``).
        port: the port to listen on; default a free one, kept across restarts.
        log: a file that receives the collector's output (appended to); default none.
        open_access: ``--open`` (no tokens: loopback only); False requires tokens.
        args: more ``qkwatch serve`` arguments.
        env: settings as ``QKWATCH_*`` environment variables, over this process's environment.
        cwd: the working directory of the collector (default this process's).
        start_timeout: seconds :meth:`start` waits for ``/healthz`` by default.
        own_group: start it in a process group of its own, so that :meth:`stop` signals the whole
            group: with ``--workers N`` that is every worker, not only uvicorn's supervisor (whose
            workers outlive a SIGKILL of it alone and keep the port).
    """

    def __init__(
        self,
        database_url: str,
        *,
        port: int | None = None,
        log: str | Path | None = None,
        open_access: bool = True,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        start_timeout: float = 60.0,
        own_group: bool = False,
    ) -> None:
        self.database_url = database_url
        self.port = port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = Path(log) if log is not None else None
        self.open_access = open_access
        self.args = tuple(args)
        self.env = dict(env or {})
        self.cwd = cwd
        self.start_timeout = start_timeout
        self.own_group = own_group
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "qkwatch.cli",
            "serve",
            *(["--open"] if self.open_access else []),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--database-url",
            self.database_url,
            *self.args,
        ]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float | None = None) -> CollectorProcess:
        """Start the collector and wait until it is healthy; returns ``self``.

        Raises:
            CollectorLaunchError: it exited, or was not healthy within ``timeout`` seconds (default
                ``start_timeout``; it is stopped then).
        """
        if self.proc is not None:
            raise RuntimeError(f"the collector at {self.url} is already running")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}  # unbuffered: the log is current when quoted
        if self.log is None:
            self.proc = proc = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_group,
            )
        else:
            with open(self.log, "a") as out:  # the child keeps its own descriptor
                self.proc = proc = subprocess.Popen(
                    self.command,
                    cwd=self.cwd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=self.own_group,
                )
        self._wait_healthy(proc, self.start_timeout if timeout is None else timeout)
        return self

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                code = proc.returncode
                self.proc = None
                raise CollectorLaunchError(f"qkwatch serve exited with status {code}{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop(hard=True)
        raise CollectorLaunchError(f"qkwatch serve did not become healthy in {timeout:g} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return f":\n{self.log.read_text(errors='replace')[-LOG_TAIL_CHARS:]}"

    def stop(self, hard: bool = False, timeout: float = 30.0) -> None:
        """SIGTERM (``hard``: SIGKILL) and wait; killed if it has not exited after ``timeout`` s. Idempotent.

        With ``own_group`` the signal goes to the collector's whole process group (its workers too).
        """
        if self.proc is None:
            return
        self._signal(signal.SIGKILL if hard else signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        if not self.own_group:
            self.proc.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(self.proc.pid, sig)  # the group's id is the leader's pid (start_new_session)

    def wait(self) -> int | None:
        """Block until the collector exits by itself (or a signal); its exit status."""
        return self.proc.wait() if self.proc is not None else None

    def client(self, token: str | None = None, timeout: float = 30.0) -> Client:
        """A :class:`qkwatch.client.rest.Client` of this collector."""
        from qkwatch.client.rest import Client

        return Client(self.url, token=token, timeout=timeout)

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
