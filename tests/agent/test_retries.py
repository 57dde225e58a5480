"""The sender's retry rules against a scripted HTTP server (a real server on loopback whose answers
the test sets): which failures are retried, Retry-After, backoff, dead letters, batch halving."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.shipper import Health, Sender
from agent.spool import Spool
from agent.transport import HttpTransport, parse_retry_after


class Scripted:
    """Answers POST /v1/runs with a run, and report batches from a script of (status, headers, body)."""

    def __init__(self, script: list[tuple[int, dict, dict]], max_reports: int | None = None):
        self.script = list(script)
        self.max_reports = max_reports
        self.batches: list[tuple[float, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/runs":
                    return self._answer(200, {}, {"id": "run-1", "attempt": 1})
                outer.batches.append((time.monotonic(), body))
                if outer.max_reports is not None and len(body["reports"]) > outer.max_reports:
                    return self._answer(413, {}, {"detail": "too many points"})
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


def spool_with(tmp_path: Path, n: int) -> Spool:
    spool = Spool(tmp_path / "spool")
    spool.write_meta({"project": "p", "name": "r", "config": {}, "attempt_key": "k", "spool_id": "s"})
    for step in range(n):
        spool.append({"attempt_key": "k", "report": {"step": step, "time": 1.0, "scalars": {"loss": 1.0}}})
    return spool


def sender(spool: Spool, url: str, **kw) -> tuple[Sender, Health]:
    health = Health()
    options = {"batch_max": 64, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.2, **kw}
    return Sender(spool, lambda: HttpTransport(url, None, 5.0), health=health, **options), health


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_retryable_statuses_are_retried_with_the_same_batch_id(tmp_path: Path, status: int) -> None:
    server = Scripted([(status, {}, {"detail": "busy"}), (status, {}, {"detail": "busy"})])
    spool = spool_with(tmp_path, 3)
    s, health = sender(spool, server.url)
    assert s.deliver_all(time.monotonic() + 20)
    ids = {body["batch_id"] for _, body in server.batches}
    assert len(server.batches) == 3 and len(ids) == 1  # a retry resends the very same batch
    assert health.retried == 2 and health.sent == 3 and not spool.pending(10)
    server.close()


def test_connection_errors_are_retried(tmp_path: Path) -> None:
    spool = spool_with(tmp_path, 2)
    s, health = sender(spool, "http://127.0.0.1:9")  # discard port: refused
    assert not s.deliver_all(time.monotonic() + 0.5)
    assert health.retried >= 2 and len(spool.pending(10)) == 2  # nothing lost, nothing acknowledged


def test_retry_after_is_honoured(tmp_path: Path) -> None:
    server = Scripted([(429, {"Retry-After": "1"}, {"detail": "slow down"})])
    s, _ = sender(spool_with(tmp_path, 1), server.url)
    assert s.deliver_all(time.monotonic() + 20)
    (t1, _), (t2, _) = server.batches
    assert t2 - t1 >= 1.0  # the server asked for a second; backoff alone would retry within 0.2 s
    server.close()


def test_other_4xx_go_to_the_dead_letter_file_with_one_warning(tmp_path: Path, caplog) -> None:
    server = Scripted([(400, {}, {"detail": "reports.0.step: bad"}), (422, {}, {"detail": "worse"})])
    spool = spool_with(tmp_path, 3)
    s, health = sender(spool, server.url, batch_max=1)
    with caplog.at_level(logging.WARNING, logger="agent.shipper"):
        assert s.deliver_all(time.monotonic() + 20)
    dead = [json.loads(line) for line in (spool.path / "dead-letter.jsonl").read_text().splitlines()]
    assert [d["status"] for d in dead] == [400, 422]
    assert "reports.0.step: bad" in dead[0]["response"] and dead[0]["reports"][0]["report"]["step"] == 0
    assert health.dead_lettered == 2 and health.sent == 1 and not spool.pending(10)
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1  # one warning, not a storm
    server.close()


def test_a_batch_too_large_is_halved(tmp_path: Path) -> None:
    server = Scripted([], max_reports=2)
    spool = spool_with(tmp_path, 7)
    s, health = sender(spool, server.url, batch_max=8)
    assert s.deliver_all(time.monotonic() + 20)
    accepted = [b for _, b in server.batches if len(b["reports"]) <= 2]
    assert sorted(r["step"] for b in accepted for r in b["reports"]) == list(range(7))
    assert health.dead_lettered == 0
    server.close()


def test_parse_retry_after() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
