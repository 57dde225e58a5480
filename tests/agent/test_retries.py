"""The sender's retry rules: which failures are retried, Retry-After, backoff, dead letters, batch halving.

The 413 (body too large) and 429 (rate limited, with Retry-After) cases run against a real
``qkwatch serve`` whose settings force them (``QKWATCH_MAX_BODY_BYTES``, ``QKWATCH_RATE_LIMIT_*``).
The others need answers a healthy collector does not give on demand (500, 502, 503, 408, a 400
for a well-formed batch): those run against a scripted server, a real HTTP server on loopback
whose answers the test sets. No test here times the sender: each counts what the server answered.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from qkwatch.agent.health import Health
from qkwatch.agent.shipping.disk_spool import Spool
from qkwatch.agent.shipping.shipper import Sender
from qkwatch.agent.shipping.transport import HttpTransport, TransportError, parse_retry_after
from tests.live import LiveCollector


class Scripted:
    """Answers POST /v1/runs with a run, and report batches from a script of (status, headers, body).

    Used only for answers the real collector cannot be made to give (see the module docstring).
    """

    def __init__(self, script: list[tuple[int, dict, dict]]):
        self.script = list(script)
        self.batches: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/runs":
                    return self._answer(200, {}, {"id": "run-1", "attempt": 1})
                outer.batches.append(body)
                status, headers, answer = outer.script.pop(0) if outer.script else (200, {}, {"inserted": 1})
                self._answer(status, headers, answer)

            def _answer(self, status, headers, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Observed:
    """The real ``HttpTransport``, noting the answer to each report batch: (HTTP status, steps, batch id).

    A pass-through, not a double: every call goes to the collector as it is.
    """

    def __init__(self, url: str, token: str | None = None):
        self.http = HttpTransport(url, token, 30.0)
        self.posts: list[tuple[int | None, list[int], str]] = []

    def post_reports(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = self.http.post_reports(run_id, body)
        except TransportError as exc:
            self.posts.append((exc.status, [r["step"] for r in body["reports"]], body["batch_id"]))
            raise
        self.posts.append((200, [r["step"] for r in body["reports"]], body["batch_id"]))
        return answer

    def __getattr__(self, name: str) -> Any:  # create_run, get_lambdas, set_status, close
        return getattr(self.http, name)


def report(step: int, values: int = 1) -> dict:
    return {"step": step, "time": 1.0, "scalars": {"loss": 1.0}, "layers": {"qkai": [0.5] * values}}


def spool_of(tmp_path: Path, reports: list[dict]) -> Spool:
    spool = Spool(tmp_path / "spool")
    spool.write_meta({"project": "tests", "name": "r", "config": {}, "attempt_key": "k", "spool_id": "s"})
    for r in reports:
        spool.append({"attempt_key": "k", "report": r})
    return spool


def spool_with(tmp_path: Path, n: int) -> Spool:
    return spool_of(tmp_path, [report(step) for step in range(n)])


def sender(spool: Spool, url_or_transport: str | Observed, **kw) -> tuple[Sender, Health]:
    health = Health()
    options = {"batch_max": 64, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.2, **kw}
    if isinstance(url_or_transport, str):
        factory = lambda: HttpTransport(url_or_transport, None, 5.0)  # noqa: E731
    else:
        factory = lambda: url_or_transport  # noqa: E731
    return Sender(spool, factory, health=health, **options), health


@pytest.mark.parametrize("status", [500, 502, 503, 408])
def test_retryable_statuses_are_retried_with_the_same_batch_id(tmp_path: Path, status: int) -> None:
    """Scripted: a healthy collector gives none of these on demand (429 runs against the real one below)."""
    server = Scripted([(status, {}, {"detail": "busy"}), (status, {}, {"detail": "busy"})])
    spool = spool_with(tmp_path, 3)
    s, health = sender(spool, server.url)
    assert s.deliver_all(time.monotonic() + 60)
    ids = {body["batch_id"] for body in server.batches}
    assert len(server.batches) == 3 and len(ids) == 1  # a retry resends the very same batch
    assert health.retried == 2 and health.sent == 3 and not spool.pending(10)
    server.close()


def test_connection_errors_are_retried(tmp_path: Path) -> None:
    """Nobody listens: the sender retries again and again (counted, not timed) and keeps every report."""
    spool = spool_with(tmp_path, 2)
    s, health = sender(spool, "http://127.0.0.1:9")  # discard port: refused
    s.start()
    deadline = time.monotonic() + 60  # generous: three refused connections take milliseconds
    while health.retried < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close(0.0)
    s._thread.join(30)
    assert health.retried >= 3 and "ConnectError" in health.last_error
    assert health.sent == health.dead_lettered == 0 and len(spool.pending(10)) == 2  # nothing lost or acknowledged


@pytest.mark.slow
def test_retry_after_of_the_collectors_rate_limit_is_honoured(tmp_path: Path) -> None:
    """A real collector allowing a token one request at once and 0.5 a second: creating the run
    takes the one, so the first batch gets 429 with ``Retry-After: 2``, the time until the next.

    The collector judges the wait: backoff alone (at most 0.2 s here) would ask again at once and
    be refused again, so exactly one 429 means the retry waited as asked, on any machine.
    """
    limits = {"QKWATCH_RATE_LIMIT_PER_S": "0.5", "QKWATCH_RATE_LIMIT_BURST": "1"}
    live = LiveCollector(tmp_path, env=limits, open_access=False)
    token = live.token("ingest")
    spool = spool_with(tmp_path, 3)
    seen = Observed(live.url, token)
    s, health = sender(spool, seen)
    with live:
        assert s.deliver_all(time.monotonic() + 120)
    assert [(status, steps) for status, steps, _ in seen.posts] == [(429, [0, 1, 2]), (200, [0, 1, 2])]
    assert len({batch for _, _, batch in seen.posts}) == 1  # the retry resends the very same batch
    assert health.retried == 1 and "HTTP 429" in health.last_error
    assert health.sent == 3 and not spool.pending(10)


@pytest.mark.slow
def test_a_batch_too_large_for_the_collector_is_halved(tmp_path: Path) -> None:
    """A real collector whose body limit fits two of these reports, not three: a refused batch is
    halved and resent at once until every report is stored; a report too large on its own is
    dead-lettered with the collector's answer."""
    reports = [report(step, values=64) for step in range(7)] + [report(7, values=256)]
    one = len(json.dumps(reports[0]))
    live = LiveCollector(tmp_path, env={"QKWATCH_MAX_BODY_BYTES": str(int(2.5 * one))})
    spool = spool_of(tmp_path, reports)
    seen = Observed(live.url)
    s, health = sender(spool, seen, batch_max=8)
    with live:
        assert s.deliver_all(time.monotonic() + 120)
        with live.client() as c:
            (run,) = c.runs(project="tests", name="r")["data"]
            rows = [json.loads(line) for line in c.export(run["id"], "jsonl") if line.strip()]
    refused = [steps for status, steps, _ in seen.posts if status == 413]
    stored = [steps for status, steps, _ in seen.posts if status == 200]
    assert {status for status, _, _ in seen.posts} == {200, 413}
    assert all(len(steps) >= 3 or 7 in steps for steps in refused)  # the limit as set: 2 fit, 3 do not
    assert all(len(steps) <= 2 and 7 not in steps for steps in stored)
    for (status, steps, _), (_, following, _) in zip(seen.posts, seen.posts[1:], strict=False):
        if status == 413 and len(steps) > 1:
            assert following == steps[: len(steps) // 2]  # halved, and sent again at once
    assert sorted(step for steps in stored for step in steps) == list(range(7))
    assert sorted(r["step"] for r in rows if r["metric"] == "loss") == list(range(7))  # each stored once
    (dead,) = [json.loads(line) for line in (spool.path / "dead-letter.jsonl").read_text().splitlines()]
    assert dead["status"] == 413 and "exceeds the limit" in dead["response"]
    assert [r["report"]["step"] for r in dead["reports"]] == [7]
    assert health.dead_lettered == 1 and health.sent == 7 and not spool.pending(10)


def test_other_4xx_go_to_the_dead_letter_file_with_one_warning(tmp_path: Path, caplog) -> None:
    """Scripted: the real collector answers a bad report with 422, but a 400 only to a malformed request."""
    server = Scripted([(400, {}, {"detail": "reports.0.step: bad"}), (422, {}, {"detail": "worse"})])
    spool = spool_with(tmp_path, 3)
    s, health = sender(spool, server.url, batch_max=1)
    with caplog.at_level(logging.WARNING, logger="qkwatch.agent.shipping.shipper"):
        assert s.deliver_all(time.monotonic() + 60)
    dead = [json.loads(line) for line in (spool.path / "dead-letter.jsonl").read_text().splitlines()]
    assert [d["status"] for d in dead] == [400, 422]
    assert "reports.0.step: bad" in dead[0]["response"] and dead[0]["reports"][0]["report"]["step"] == 0
    assert health.dead_lettered == 2 and health.sent == 1 and not spool.pending(10)
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # one warning, not a storm
    server.close()


def test_parse_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
