"""A hostile collector cannot end, stall or bloat the training run, nor read or forge what it must not.

Each test runs a real agent on a tiny model's training loop against :class:`Hostile`, a real HTTP
server on a loopback port (raw sockets: it answers in ways no well-behaved server framework will:
an endless body, a trickle, 50 MB, redirects, HTML 500s, JSON of the wrong shape, a 400-digit
version). A healthy collector cannot be made to answer like this, so it is scripted here. The
asserts: the loop finishes, ``attach()`` keeps within its start-up budget (a generous bound, not a
stopwatch), the process grows by less than 64 MB, nothing is raised, each fault is warned about
once, and the token is never shown.

Every test here failed before issue 42's fixes (each says how).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from qkwatch import agent
from qkwatch.agent.agent import Agent
from tests.agent.tiny import TinyGPT, batch

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
STORED = json_answer({"inserted": 1})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a handler still trickling when the test ends does not hold the process
    allow_reuse_address = True


class Hostile:
    """Answers each route (``runs``, ``lambdas``, ``reports``, ``status``) with the answer set for it.

    ``answers`` may be changed while it runs; each request is noted (route, headers, body).
    """

    def __init__(self, **answers: Answer):
        self.answers: dict[str, Answer] = {"runs": RUN, "lambdas": LAMBDAS, "reports": STORED, "status": STORED}
        self.answers.update(answers)
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
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
        self.answers[route](Exchange(conn, method, path, headers, body, self.stop))

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


@pytest.fixture
def hostile() -> Iterator[Callable[..., Hostile]]:
    made: list[Hostile] = []

    def make(**answers: Answer) -> Hostile:
        made.append(Hostile(**answers))
        return made[-1]

    yield make
    for server in made:
        server.close()


# --- the training run ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def warmed_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One healthy run first, so that memory is measured against a process that has trained before
    (torch's first forward and backward allocate for good)."""
    server = Hostile()
    try:
        Run(server.url, tmp_path_factory.mktemp("warm-up") / "spool")()
    finally:
        server.close()


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

    def __init__(self, url: str, spool: Path, steps: int = 12, sleep: float = 0.02, **settings: Any):
        self.url, self.spool, self.steps, self.sleep, self.settings = url, spool, steps, sleep, settings
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
            a.step(step)
            lams = a.lambdas()
            assert lams is not None
            self.lambdas.append(lams)
            x = batch(step)
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            a.log(step, loss=loss.detach())
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


def assert_healthy_run(run: Run, memory: Memory, caplog: pytest.LogCaptureFixture) -> None:
    """The loop finished with finite losses and sane lambdas, in budget, in memory, each fault said once."""
    assert len(run.losses) == run.steps and all(math.isfinite(v) for v in run.losses)
    assert all(0.0 <= v <= LAMBDA_MAX and math.isfinite(v) for lams in run.lambdas for v in lams)
    assert run.attach_seconds < ATTACH_BOUND
    assert run.threads_alive_before_close["sender"]
    assert memory.growth() < 64 * MB
    warned = Counter(qkwatch_warnings(caplog))
    assert warned and max(warned.values()) == 1, warned  # each fault once
    assert_token_never_shown(run, caplog)


def assert_token_never_shown(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    assert TOKEN not in caplog.text
    assert run.agent is not None
    assert TOKEN not in repr(run.agent.cfg) and TOKEN not in str(run.agent.health.last_error)
    for path in run.spool.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


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


@pytest.mark.parametrize("name", list(EVERY_ROUTE))
def test_no_answer_on_any_route_ends_stalls_or_bloats_the_run(
    name: str, hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix: the wrong shapes raised out of attach(); endless and 50 MB answers were read
    whole; a trickle held attach() for tens of seconds; 307 and 500 were said only at DEBUG."""
    caplog.set_level(logging.DEBUG)
    answer, said = EVERY_ROUTE[name]
    server = hostile(runs=answer, lambdas=answer, reports=answer, status=answer)
    memory = Memory()
    run = finish(Run(server.url, tmp_path / "spool"))
    assert_healthy_run(run, memory, caplog)
    assert any(said in w for w in qkwatch_warnings(caplog)), qkwatch_warnings(caplog)


LAMBDA_ANSWERS: dict[str, Answer] = {
    "an array": json_answer([0.1, 0.1, 0.1, 0.1]),
    "null": json_answer(None),
    "lambdas null": json_answer({"version": 2, "lambdas": None}),
    "a 400-digit version": raw_answer('{"version": 1' + "0" * 400 + ', "lambdas": [0.01, 0.01, 0.01, 0.01]}'),
    "an endless answer": endless,
    "HTML 500": html_500,
}


@pytest.mark.parametrize("name", list(LAMBDA_ANSWERS))
def test_a_bad_lambdas_answer_is_ignored_and_the_poller_polls_on(
    name: str, hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix: a 400-digit version raised OverflowError out of lambdas(); an array or null
    raised out of attach(), and killed the poller."""
    caplog.set_level(logging.DEBUG)
    server = hostile(lambdas=LAMBDA_ANSWERS[name])
    memory = Memory()
    run = finish(Run(server.url, tmp_path / "spool", steps=16))
    assert_healthy_run(run, memory, caplog)
    assert run.threads_alive_before_close["poller"]
    assert server.count("lambdas") >= 3  # polled on after the bad answers
    assert server.reports()  # and the reports went out


@pytest.mark.parametrize("bad_run", ["{}", '{"id": null}', '"attempt": "two"', "an array"])
def test_a_bad_run_answer_does_not_kill_the_sender(
    bad_run: str, hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The collector answers POST /v1/runs badly, then well: every report is delivered.

    Before the fix the first bad answer killed the sender thread, and nothing more was delivered.
    """
    caplog.set_level(logging.DEBUG)
    answer = EVERY_ROUTE[bad_run][0]
    server = hostile(runs=answer)
    memory = Memory()
    steps = 12
    runner = Run(server.url, tmp_path / "spool", steps=steps)

    def heal_then_run() -> Run:
        def heal() -> None:
            while server.count("runs") < 3:  # attach's answer and at least one of the sender's
                time.sleep(0.01)
            server.answers["runs"] = RUN

        threading.Thread(target=heal, daemon=True).start()
        return runner(close_timeout=20.0)

    run = finish(heal_then_run)
    assert_healthy_run(run, memory, caplog)
    assert sorted({r["step"] for r in server.reports()}) == list(range(steps))


# --- redirects are failures to retry, not refusals ---------------------------------------------


def test_a_redirect_is_retried_and_nothing_goes_to_the_dead_letters(
    hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Reports answered 307 stay spooled and are delivered once the collector answers well.

    Before the fix a 3xx counted as a refusal: every report went to dead-letter.jsonl, undelivered.
    """
    caplog.set_level(logging.DEBUG)
    server = hostile(reports=redirect)
    memory = Memory()
    steps = 12
    runner = Run(server.url, tmp_path / "spool", steps=steps)

    def heal_then_run() -> Run:
        def heal() -> None:
            while server.count("reports") < 5:
                time.sleep(0.01)
            server.answers["reports"] = STORED

        threading.Thread(target=heal, daemon=True).start()
        return runner(close_timeout=20.0)

    run = finish(heal_then_run)
    assert_healthy_run(run, memory, caplog)
    assert not list(tmp_path.rglob("dead-letter.jsonl"))
    assert sorted({r["step"] for r in server.reports()}) == list(range(steps))
    (said,) = [w for w in qkwatch_warnings(caplog) if "307" in w]
    assert "not followed" in said


def test_close_says_what_it_could_not_deliver(
    hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close() gives up on a trickled answer and says reports are left.

    Before the fix: close() returned with the sender still inside the request, and said nothing.
    """
    server = hostile(reports=trickle)
    run = finish(Run(server.url, tmp_path / "spool", request_timeout=30.0))
    left = [w for w in qkwatch_warnings(caplog) if "not taken every report" in w]
    assert len(left) == 1 and str(run.spool) in left[0]
    assert TOKEN not in caplog.text


# --- lambdas bounded in change ------------------------------------------------------------------------


def test_a_forged_jump_to_lambda_max_is_applied_a_bounded_step_per_exchange_and_recorded(
    hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A man in the middle serves lambda_max for every layer: the lambdas climb at most a quarter of
    lambda_max per exchange, one warning says so, and the reports carry every change as an event.

    Before the fix every lambda was lambda_max one poll later.
    """
    server = hostile(lambdas=json_answer({"version": 1, "lambdas": [0.0] * 4}))
    runner = Run(server.url, tmp_path / "spool", steps=30, sleep=0.03)

    def forge_then_run() -> Run:
        def forge() -> None:
            while not runner.lambdas:
                time.sleep(0.005)
            server.answers["lambdas"] = json_answer({"version": 2, "lambdas": [LAMBDA_MAX] * 4})

        threading.Thread(target=forge, daemon=True).start()
        return runner(close_timeout=20.0)

    run = finish(forge_then_run)
    assert run.lambdas[0] == [0.0] * 4
    bound = 0.25 * LAMBDA_MAX + 1e-12
    for before, after in itertools.pairwise(run.lambdas):
        assert all(abs(b - a) <= bound for b, a in zip(before, after, strict=True)), (before, after)
    assert run.lambdas[-1] == pytest.approx([LAMBDA_MAX] * 4)  # it does get there, in steps
    (said,) = [w for w in qkwatch_warnings(caplog) if "lambda_max_change" in w]
    assert "layer 0" in said
    changes = [e for r in server.reports() for e in r.get("events", []) if e["kind"] == "lambda_changed"]
    assert changes and {item["layer"] for e in changes for item in e["data"]["layers"]} == {0, 1, 2, 3}
    assert changes[0]["data"]["layers"][0]["requested"] == LAMBDA_MAX


# --- secrets ----------------------------------------------------------------------------------------------


def test_a_token_read_from_a_file_is_stripped_and_never_shown(
    hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix the token kept its newline, httpx refused the header and the INFO line quoted it."""
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = hostile()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(
        model, url=server.url, token=token_file.read_text(), project="tests", run="tok", spool=str(tmp_path / "s")
    )
    a.close(1.0)
    assert {h.get("authorization") for _, h, _ in server.seen} == {f"Bearer {TOKEN}"}
    assert TOKEN not in caplog.text and TOKEN not in repr(a.cfg)


@pytest.mark.parametrize("token", ["s3cret-tökén", "s3cret token", "s3cret\ttoken", "s3cret\r\nX-Evil: 1"])
@pytest.mark.parametrize("source", ["argument", "environment"])
def test_a_token_a_header_cannot_carry_is_refused_in_one_line_that_does_not_show_it(
    token: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix a non-ASCII token raised UnicodeEncodeError out of attach(), quoting it."""
    explicit = {"token": token} if source == "argument" else {}
    if source == "environment":
        monkeypatch.setenv("QKWATCH_TOKEN", token)
    with pytest.raises(ValueError) as raised:
        agent.attach(TinyGPT(), url="http://127.0.0.1:9", project="tests", run="t", spool=str(tmp_path), **explicit)
    message = str(raised.value)
    assert "token" in message and "\n" not in message.strip()
    assert "s3cret" not in message and "s3cret" not in repr(raised.value)


def test_a_token_over_plain_http_to_a_remote_host_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loopback and https are not warned about; a remote http:// host is, once, without the token."""
    for i, url in enumerate(("http://127.0.0.1:9", "http://localhost:9", "https://qkwatch.invalid:9")):
        spool = str(tmp_path / str(i))
        agent.attach(TinyGPT(), url=url, token=TOKEN, project="tests", run="l", spool=spool).close(0.1)
    assert not [w for w in qkwatch_warnings(caplog) if "plain http://" in w]
    a = agent.attach(
        TinyGPT(), url="http://qkwatch.invalid:9", token=TOKEN, project="tests", run="r", spool=str(tmp_path / "b")
    )
    a.close(0.1)
    (said,) = [w for w in qkwatch_warnings(caplog) if "plain http://" in w]
    assert "qkwatch.invalid" in said and TOKEN not in caplog.text


@pytest.mark.parametrize("change", [0, -0.1, 1.5, float("nan"), "0.5"])
def test_lambda_max_change_is_a_fraction_in_zero_to_one(change: object, tmp_path: Path) -> None:
    a = agent.attach(TinyGPT(), project="tests", run="ok", spool=str(tmp_path / "ok"), lambda_max_change=0.5)
    a.close(0.1)
    assert a.lambdas_state.max_change == 0.5
    with pytest.raises(ValueError, match=r"lambda_max_change must be in \(0, 1\]"):
        agent.attach(TinyGPT(), project="tests", run="c", spool=str(tmp_path / "c"), lambda_max_change=change)


def test_dead_letters_can_be_requeued_and_are_then_delivered(hostile: Callable[..., Hostile], tmp_path: Path) -> None:
    """Reports a collector refused for good (400) go to dead-letter.jsonl; once requeued, a sync delivers
    every one of them. Before the fix nothing re-sent dead letters."""
    from qkwatch.agent.disk_spool import Spool
    from qkwatch.agent.shipper import requeue_dead_letters
    from qkwatch.agent.sync import sync

    refusing = hostile(reports=json_answer({"detail": "no"}, status=400))
    steps = 8
    run = finish(Run(refusing.url, tmp_path / "spool", steps=steps))
    (path,) = {p.parent for p in run.spool.rglob("dead-letter.jsonl")}
    with (path / "dead-letter.jsonl").open("a") as fh:
        fh.write("not a dead letter\n")
    healthy = hostile()
    spool = Spool(path)
    try:
        assert requeue_dead_letters(spool) >= steps
        assert requeue_dead_letters(spool) == 0  # the file was set aside: a second call re-sends nothing
    finally:
        spool.close()
    assert not (path / "dead-letter.jsonl").exists() and list(path.glob("dead-letter.resent-*.jsonl"))
    sync(path, healthy.url, TOKEN, timeout=30.0)
    assert sorted({r["step"] for r in healthy.reports()}) == list(range(steps))


def test_qkwatch_spool_resend_delivers_the_refused_reports(
    hostile: Callable[..., Hostile], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line: ``qkwatch spool resend DIR --collector URL`` puts every refused report back and
    delivers it; a second run has nothing left to re-send."""
    from qkwatch.cli import main

    refusing = hostile(reports=json_answer({"detail": "no"}, status=400))
    steps = 6
    run = finish(Run(refusing.url, tmp_path / "spool", steps=steps))
    healthy = hostile()
    args = ["spool", "resend", str(run.spool), "--collector", healthy.url, "--token", TOKEN, "--timeout", "30"]
    assert main(args) == 0
    assert sorted({r["step"] for r in healthy.reports()}) == list(range(steps))
    assert "refused report(s) back in the spool" in capsys.readouterr().out
    assert main(args) == 0
    assert " 0 refused report(s) back in the spool" in capsys.readouterr().out
