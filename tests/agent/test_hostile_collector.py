"""A hostile collector cannot end, stall or bloat the training run, nor read or forge what it must not.

Each test runs a real agent on a tiny model's training loop against ``faults.Hostile``, a real HTTP
server on a loopback port that answers as no well-behaved server would (a healthy collector cannot
be made to, so it is scripted). The suite of every answer on every route, and of the disk's faults,
is ``test_fault_injection.py``; these tests take one route or one promise at a time. The
asserts: the loop finishes, ``attach()`` keeps within its start-up budget (a generous bound, not a
stopwatch), the process grows by less than 64 MB, nothing is raised, each fault is warned about
once, and the token is never shown.

Every test here failed before issue 42's fixes (each says how).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from qkwatch import agent
from tests.agent.faults import (
    EVERY_ROUTE,
    LAMBDA_MAX,
    RUN,
    STORED,
    TOKEN,
    Answer,
    Hostile,
    Memory,
    Run,
    assert_healthy_run,
    endless,
    finish,
    html_500,
    json_answer,
    qkwatch_warnings,
    raw_answer,
    redirect,
    trickle,
)
from tests.agent.tiny import TinyGPT


@pytest.fixture(scope="module", autouse=True)
def warmed_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One healthy run first, so that memory is measured against a process that has trained before
    (torch's first forward and backward allocate for good)."""
    server = Hostile()
    try:
        Run(server.url, tmp_path_factory.mktemp("warm-up") / "spool")()
    finally:
        server.close()


# --- one route at a time (every route at once, and the disk: test_fault_injection.py) ---------------

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
    from qkwatch.agent.shipping.disk_spool import Spool
    from qkwatch.agent.shipping.shipper import requeue_dead_letters
    from qkwatch.agent.shipping.sync import sync

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
