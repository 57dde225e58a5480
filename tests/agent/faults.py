"""The faults the training run meets, and a real training run to meet them: the agent's tests' harness.

:class:`Hostile` is a real HTTP server on a loopback port that answers in ways no well-behaved
server framework will (raw sockets: an endless body, a trickle, 50 MB, redirects, HTML 500s, JSON
of the wrong shape, a 400-digit version). A healthy collector cannot be made to answer like this,
so it is scripted here. :class:`FaultyOs` is ``os`` as the spool module sees it, with a ``write``
that fails or falls short on demand (the kernel gives no way to ask for a short write);
:func:`mount_tmpfs` gives a real small disk to fill. :class:`Run` trains a tiny model with the
agent attached; :class:`Memory` samples the process's resident memory meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import socketserver
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.agent import Agent
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.tiny import TinyGPT, train_step

TOKEN = "s3cret-token-0123456789"
MB = 1 << 20
LAMBDA_MAX = 0.2
SCHEDULE = {"lambda_0": 0.1, "h_star": 0.75, "beta": 0.05, "lambda_max": LAMBDA_MAX}
FAST = {
    "every": 2,
    "spectra_every": 0,
    "flush_seconds": 0.05,
    "backoff_base": 0.05,
    "backoff_cap": 0.2,
    "lambda_poll_seconds": 0.05,
    "lambda_sync_every": 1,
    "request_timeout": 2.0,
}
ATTACH_BOUND = 15.0
"""attach() spends at most INITIAL_FETCH_SECONDS (2 s) on the collector; this bound only catches a stall."""
OLD_CODE_GUARD = 90.0
"""How long a run may take before the test calls it stalled (before the fix some never ended)."""

Answer = Callable[["Exchange"], None]


# --- the hostile collector ---------------------------------------------------------------------


class Exchange:
    """One request as the server read it, and the raw socket to answer on."""

    def __init__(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes, stop: Any):
        self.conn, self.method, self.path, self.headers, self.body, self.stop = conn, method, path, headers, body, stop

    def head(self, status: int, headers: dict[str, str]) -> None:
        lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in {**headers, "Connection": "close"}.items()]
        self.conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def send(self, status: int, body: bytes, content_type: str = "application/json", **headers: str) -> None:
        self.head(status, {"Content-Type": content_type, "Content-Length": str(len(body)), **headers})
        self.conn.sendall(body)


def json_answer(value: Any, status: int = 200) -> Answer:
    return lambda ex: ex.send(status, json.dumps(value).encode())


def raw_answer(text: str, status: int = 200) -> Answer:
    return lambda ex: ex.send(status, text.encode())


def endless(ex: Exchange) -> None:
    """200, no length, blanks for ever (about 30 MB/s: the unfixed agent read them all)."""
    ex.head(200, {"Content-Type": "application/json"})
    chunk = b" " * 65536
    while not ex.stop.is_set():
        ex.conn.sendall(chunk)
        time.sleep(0.002)


def trickle(ex: Exchange) -> None:
    """200 with a length of 1000, a byte every 0.3 s: each read is in time, the whole never is."""
    ex.head(200, {"Content-Type": "application/json", "Content-Length": "1000"})
    for _ in range(1000):
        if ex.stop.wait(0.3):
            return
        ex.conn.sendall(b" ")


def trickled_headers(ex: Exchange) -> None:
    """A status line, then a header a byte every 0.3 s: every read is in time, the headers never end."""
    ex.conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not ex.stop.wait(0.3):
        ex.conn.sendall(b"a")


def huge(declared: bool) -> Answer:
    """200 with 50 MB of blanks and then a run, with or without a Content-Length."""

    def answer(ex: Exchange) -> None:
        tail = json.dumps({"id": "run-1", "attempt": 1}).encode()
        size = 50 * MB + len(tail)
        ex.head(200, {"Content-Type": "application/json", **({"Content-Length": str(size)} if declared else {})})
        chunk = b" " * MB
        for _ in range(50):
            ex.conn.sendall(chunk)
        ex.conn.sendall(tail)

    return answer


def echo_400(ex: Exchange) -> None:
    """A refusal that quotes the request's headers, token and all."""
    ex.send(400, json.dumps({"detail": f"bad request with {ex.headers}"}).encode())


def redirect(ex: Exchange) -> None:
    ex.send(307, b"", Location="http://127.0.0.1:9/elsewhere")


def html_500(ex: Exchange) -> None:
    ex.send(500, b"<html><body><h1>Internal Server Error</h1></body></html>", "text/html")


RUN = json_answer({"id": "run-1", "attempt": 1})
LAMBDAS = json_answer({"version": 1, "lambdas": [0.01] * 4})
STORED = json_answer({"inserted": 1, "duplicates": 0})
HEALTHY: dict[str, Answer] = {"runs": RUN, "lambdas": LAMBDAS, "reports": STORED, "status": STORED}


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a handler still trickling when the test ends does not hold the process
    allow_reuse_address = True


class Hostile:
    """Answers each route (``runs``, ``lambdas``, ``reports``, ``status``) with the answer set for it.

    ``answers`` may be changed while it runs; each request is noted (route, headers, body). With
    ``every_other``, the set answers go to a route's first, third, fifth... request and the healthy
    ones to the others (a collector that fails now and then, so that retries meet both).
    """

    def __init__(self, every_other: bool = False, **answers: Answer):
        self.answers: dict[str, Answer] = {**HEALTHY, **answers}
        self.every_other = every_other
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.acknowledged: list[dict[str, Any]] = []
        """The reports of each request answered with the healthy ``STORED``."""
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError):
                    outer._handle(self.request)

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        request, *lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        while len(body) < int(headers.get("content-length", "0")):
            body += conn.recv(65536)
        route = self.route(method, path)
        self.seen.append((route, headers, body))
        answer = self.answers[route]
        if self.every_other and self.count(route) % 2 == 0:
            answer = HEALTHY[route]
        if answer is STORED and route == "reports":
            self.acknowledged += json.loads(body)["reports"]
        answer(Exchange(conn, method, path, headers, body, self.stop))

    @staticmethod
    def route(method: str, path: str) -> str:
        if path == "/v1/runs":
            return "runs"
        if path.endswith("/lambdas"):
            return "lambdas"
        if path.endswith("/reports"):
            return "reports"
        return "status"

    def count(self, route: str) -> int:
        return sum(r == route for r, _, _ in self.seen)

    def reports(self) -> list[dict[str, Any]]:
        """Every report posted (whatever the answer was)."""
        return [r for route, _, body in self.seen if route == "reports" for r in json.loads(body)["reports"]]

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


class Memory:
    """The process's resident memory, sampled every 10 ms: the largest rise over the start."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


class Run:
    """A real agent on a tiny model: attach, train ``steps`` steps (lambdas every step), close."""

    def __init__(
        self,
        url: str | None,
        spool: Path,
        steps: int = 12,
        sleep: float = 0.02,
        at_step: dict[int, Callable[[], object]] | None = None,
        **settings: Any,
    ):
        self.url, self.spool, self.steps, self.sleep, self.settings = url, spool, steps, sleep, settings
        self.at_step = at_step or {}
        """What to do before a step (the disk fills, say)."""
        self.attach_seconds = math.inf
        self.losses: list[float] = []
        self.lambdas: list[list[float]] = []
        self.agent: Agent | None = None
        self.threads_alive_before_close: dict[str, bool] = {}

    def __call__(self, close_timeout: float = 1.0) -> Run:
        torch.manual_seed(0)
        model = TinyGPT()
        start = time.monotonic()
        a = self.agent = agent.attach(
            model,
            url=self.url,
            token=TOKEN,
            project="tests",
            run="hostile",
            spool=str(self.spool),
            config={"schedule": SCHEDULE},
            **{**FAST, **self.settings},
        )
        self.attach_seconds = time.monotonic() - start
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(self.steps):
            if step in self.at_step:
                self.at_step[step]()
            a.step(step)
            lams = a.lambdas()
            assert lams is not None
            self.lambdas.append(lams)
            loss = train_step(model, opt, step)
            a.log(step, loss=loss)
            self.losses.append(loss.item())
            time.sleep(self.sleep)
        self.threads_alive_before_close = {
            "sender": a.sender._thread.is_alive(),
            "poller": a.poller is not None and a.poller._thread.is_alive(),
        }
        a.close(close_timeout)
        return self


def finish(run: Callable[[], Run], guard: float = OLD_CODE_GUARD) -> Run:
    """``run()`` on a thread; its exception re-raised here; a stall (the unfixed agent's) fails the test."""
    out: list[Run] = []
    raised: list[BaseException] = []

    def target() -> None:
        try:
            out.append(run())
        except BaseException as exc:  # re-raised on the test's thread
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(guard)
    assert not thread.is_alive(), f"the training run did not finish within {guard} s"
    if raised:
        raise raised[0]
    return out[0]


def qkwatch_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("qkwatch") and r.levelno >= logging.WARNING]


def assert_healthy_run(run: Run, memory: Memory, caplog: pytest.LogCaptureFixture, warned_of: bool = True) -> None:
    """The loop finished with finite losses and sane lambdas, in budget, in memory, each fault said once
    (and, with ``warned_of``, at least one said)."""
    assert len(run.losses) == run.steps and all(math.isfinite(v) for v in run.losses)
    assert all(0.0 <= v <= LAMBDA_MAX and math.isfinite(v) for lams in run.lambdas for v in lams)
    assert run.attach_seconds < ATTACH_BOUND
    assert run.threads_alive_before_close["sender"]
    assert memory.growth() < 64 * MB
    warned = Counter(qkwatch_warnings(caplog))
    assert max(warned.values(), default=1) == 1, warned  # each fault once
    assert warned or not warned_of
    assert_token_never_shown(run, caplog)


def assert_token_never_shown(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    assert TOKEN not in caplog.text
    assert run.agent is not None
    assert TOKEN not in repr(run.agent.cfg) and TOKEN not in str(run.agent.health.last_error)
    for path in run.spool.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def let_go(run: Run, seconds: float = 10.0) -> None:
    """Wait for the closed agent's sender to end its last request (close() does not wait past its
    timeout), and unlock the spool."""
    assert run.agent is not None
    run.agent.sender._thread.join(seconds)
    assert not run.agent.sender._thread.is_alive(), f"the sender still runs {seconds} s after close()"
    run.agent.spool.close()


def kept(spool: Path) -> list[dict[str, Any]]:
    """The reports still in the spool at ``spool`` (every rank): those pending, and the dead letters."""
    out: list[dict[str, Any]] = []
    for meta in spool.rglob("meta.json"):
        held = Spool(meta.parent)
        try:
            out += [r.payload["report"] for r in held.pending(10**6) if "report" in r.payload]
        finally:
            held.close()
        dead = meta.parent / "dead-letter.jsonl"
        if dead.exists():
            letters = [json.loads(line)["reports"] for line in dead.read_text().splitlines()]
            out += [p["report"] for payloads in letters for p in payloads if "report" in p]
    return out


# --- the disk ----------------------------------------------------------------------------------------


class FaultyOs:
    """``os`` as the spool module sees it, with a ``write`` that fails or falls short on demand."""

    def __init__(self) -> None:
        self.full = False
        self.short = False

    def write(self, fd: int, data: Any) -> int:
        if self.full:
            raise OSError(28, "No space left on device")
        if self.short and len(data) > 1:
            return os.write(fd, bytes(data[: len(data) // 2]))  # as a nearly full disk does
        return os.write(fd, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def mount_tmpfs(mount: Path, size: str) -> None:
    """A tmpfs of ``size`` at ``mount`` (unmount with ``umount -l``); skips without root, fails under CI=true."""
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs as root and must mount a tmpfs: {done.stderr.decode().strip()}")
        pytest.skip("mounting a tmpfs needs root")


# --- every answer, on every route ------------------------------------------------------------------

EVERY_ROUTE: dict[str, tuple[Answer, str]] = {
    # answer: what its one warning says
    "endless": (endless, "longer than"),
    "trickle": (trickle, "deadline"),
    "trickled headers": (trickled_headers, "deadline"),
    "50 MB with a length": (huge(True), "declares"),
    "50 MB without a length": (huge(False), "longer than"),
    "307": (redirect, "redirect"),
    "HTML 500": (html_500, "HTTP 500"),
    "HTML 200": (raw_answer("<html>ok</html>"), "not JSON"),
    "an array": (json_answer([1, 2]), "not an object"),
    "null": (json_answer(None), "not an object"),
    "{}": (json_answer({}), "does not fit"),
    '{"id": null}': (json_answer({"id": None}), "does not fit"),
    '"attempt": "two"': (json_answer({"id": "run-1", "attempt": "two"}), "does not fit"),
    "a 400-digit version": (raw_answer('{"id": "run-1", "version": 1' + "0" * 400 + "}"), "does not fit"),
    "a 400 quoting the token": (echo_400, "refused"),
}
