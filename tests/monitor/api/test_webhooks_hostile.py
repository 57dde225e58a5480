"""Red team, webhooks (issue 34): targets that should not be reached, receivers that misbehave, and a
signature receivers can check. Real HTTP servers on loopback; the notifier as the collector runs it.

* private targets (loopback, link-local metadata 169.254.169.254) are refused unless the operator
  allows them, and nothing is sent to them;
* a closed port, an answer that never ends, an answer too long, and a redirect to an internal host
  each fail the delivery within the time allowed, without following the redirect;
* a delivery stuck on a receiver that never answers holds no request: ingest goes on meanwhile;
* with a secret every body is signed (HMAC-SHA256 of timestamp and body), and the receiver's check
  fails on a changed body or a wrong secret.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from qkwatch.monitor.alerting.webhooks import SIGNATURE, TIMESTAMP, verify
from tests.live import free_port
from tests.monitor.api.test_alerts import qkai_reports
from tests.monitor.conftest import report


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    return isolated_db_url


class Server:
    """A loopback HTTP server whose POST handler is ``handle(request_handler)``; records what reached it."""

    def __init__(self, handle: Callable[[http.server.BaseHTTPRequestHandler], None]) -> None:
        self.hits: list[tuple[dict[str, str], bytes]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                server.hits.append((dict(self.headers), body))
                handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(h: http.server.BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.end_headers()


@pytest.fixture
def served() -> Iterator[Callable[[Callable[[http.server.BaseHTTPRequestHandler], None]], Server]]:
    servers: list[Server] = []

    def make(handle: Callable[[http.server.BaseHTTPRequestHandler], None]) -> Server:
        servers.append(Server(handle))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def alert(h) -> None:
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))


def last_error(h) -> str:
    with h.store.engine.connect() as conn:
        return (
            conn.exec_driver_sql("SELECT last_error FROM alert_notifications ORDER BY id DESC LIMIT 1").scalar() or ""
        )


@pytest.mark.parametrize("target", ["loopback", "metadata"])
def test_a_private_target_is_refused_unless_allowed(make_harness, served, target: str) -> None:
    receiver = served(ok)
    url = receiver.url if target == "loopback" else "http://169.254.169.254/latest/meta-data/"
    h = make_harness(webhook_urls=url)
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 0
    assert receiver.hits == []
    assert "non-public address" in last_error(h) and "QKWATCH_WEBHOOK_ALLOW_PRIVATE" in last_error(h)
    allowed = make_harness(webhook_urls=receiver.url, webhook_allow_private=True)
    if target == "loopback":
        alert(allowed)
        assert allowed.app.state.notifier.deliver_pending() >= 1 and receiver.hits


def test_a_closed_port_fails_the_delivery_cleanly(make_harness) -> None:
    h = make_harness(webhook_urls=f"http://127.0.0.1:{free_port()}/hook", webhook_allow_private=True)
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 0
    assert "ConnectError" in last_error(h)


def test_an_endless_answer_is_cut_off_in_the_time_allowed(make_harness, served) -> None:
    def endless(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.end_headers()
        for _ in range(600):  # a byte every 0.1 s for a minute: never a read timeout, never an end
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(0.1)

    receiver = served(endless)
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True, webhook_timeout_s=1.0)
    alert(h)
    start = time.monotonic()
    assert h.app.state.notifier.deliver_pending() == 0
    assert time.monotonic() - start < 10  # cut off after about 1 s, not after the minute the answer lasts
    assert "cut off" in last_error(h)


def test_a_huge_answer_is_cut_off_at_its_size(make_harness, served) -> None:
    def huge(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("content-length", str(50 << 20))
        handler.end_headers()
        for _ in range(50):
            handler.wfile.write(b"x" * (1 << 20))

    receiver = served(huge)
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True, webhook_max_response_bytes=4096)
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 0
    assert "longer than 4096 bytes" in last_error(h)


def test_a_redirect_to_an_internal_host_is_not_followed(make_harness, served) -> None:
    internal = served(ok)

    def moved(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(307)
        handler.send_header("location", internal.url)
        handler.end_headers()

    receiver = served(moved)
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True)
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 0
    assert len(receiver.hits) == 1 and internal.hits == []
    assert "HTTP 307 (redirects are not followed)" in last_error(h)


def test_a_stuck_delivery_never_blocks_ingest(make_harness, served) -> None:
    """The maintenance thread delivers to a receiver that holds the request until released; while it
    is held, reports are ingested and answered."""
    release, holding = threading.Event(), threading.Event()

    def hold(handler: http.server.BaseHTTPRequestHandler) -> None:
        holding.set()
        release.wait(60)
        ok(handler)

    receiver = served(hold)
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True, webhook_timeout_s=120, background=True)
    try:
        alert(h)  # wakes the maintenance thread, which posts and is held
        assert holding.wait(30), "the maintenance thread never reached the receiver"
        other = h.create_run()
        for step in range(5):
            h.send(other["id"], [report(step, {"qkai": [0.3]})])  # answered while the delivery is held
        assert h.get(f"/v1/runs/{other['id']}")["last_step"] == 4
    finally:
        release.set()


def test_bodies_are_signed_and_the_receivers_check_catches_tampering(make_harness, served) -> None:
    receiver = served(ok)
    secret = "s3cret-shared-with-the-receiver"
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True, webhook_secret=secret)
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 1
    (headers, body), now = receiver.hits[0], time.time()
    timestamp, signature = headers[TIMESTAMP], headers[SIGNATURE]
    assert signature.startswith("sha256=") and abs(int(timestamp) - now) < 60
    assert verify(secret, timestamp, signature, body, now)
    assert not verify(secret, timestamp, signature, body.replace(b"firing", b"resolved"), now)
    assert not verify("another secret", timestamp, signature, body, now)
    assert not verify(secret, timestamp, signature, body, now + 3600)  # a replay an hour later
    unsigned = make_harness(webhook_urls=receiver.url, webhook_allow_private=True)
    alert(unsigned)
    unsigned.app.state.notifier.deliver_pending()
    assert SIGNATURE not in receiver.hits[-1][0]


def test_an_unresolvable_host_is_a_failed_delivery_not_a_crash(make_harness) -> None:
    host = "no-such-host.invalid"
    socket.setdefaulttimeout(None)
    h = make_harness(webhook_urls=f"http://{host}/hook")
    alert(h)
    assert h.app.state.notifier.deliver_pending() == 0
    assert f"cannot resolve {host}" in last_error(h)
