"""Webhook delivery to a real HTTP server on loopback (allowed: a private target), Alertmanager's format, retries.

The notifier delivers every pending notification in its database, so these tests get a
database of their own on PostgreSQL too.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from tests.monitor.api.test_alerts import qkai_reports


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    return isolated_db_url


class Receiver:
    """A tiny real webhook receiver on loopback; answers 500 to the first ``fail_first`` posts."""

    def __init__(self, fail_first: int = 0) -> None:
        self.bodies: list[dict] = []
        self.fail_first = fail_first
        self.got = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                receiver.bodies.append(body)
                status = 500 if len(receiver.bodies) <= receiver.fail_first else 200
                self.send_response(status)
                self.end_headers()
                receiver.got.set()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver(fail_first=1)
    yield r
    r.close()


def test_webhooks_get_alertmanager_payloads_with_retries(make_harness, receiver: Receiver):
    h = make_harness(webhook_urls=receiver.url, webhook_allow_private=True)
    notifier = h.app.state.notifier
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))
    assert notifier.deliver_pending() == 0  # the receiver fails the first post
    assert len(receiver.bodies) == 1
    assert notifier.deliver_pending() == 0  # not due yet: backoff
    far = 10**10
    assert notifier.deliver_pending(now=far) == 1
    assert len(receiver.bodies) == 2 and receiver.bodies[0] == receiver.bodies[1]
    body = receiver.bodies[1]
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "qkwatch"
    alert = body["alerts"][0]
    assert alert["labels"]["alertname"] == "qkai_high" and alert["labels"]["run"] == run["name"]
    assert alert["annotations"]["layers"] == "0" and alert["annotations"]["onset_step"] == "0"
    assert alert["startsAt"].endswith("Z") and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert notifier.deliver_pending(now=far) == 0  # delivered once, never again
    h.send(run["id"], qkai_reports(30, [[0.1]]))
    assert notifier.deliver_pending(now=far) == 1
    resolved = receiver.bodies[-1]
    assert resolved["status"] == "resolved" and resolved["alerts"][0]["annotations"]["resolved_step"] == "30"
    assert resolved["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"


def test_webhook_gives_up_after_max_attempts(make_harness):
    r = Receiver(fail_first=100)
    try:
        h = make_harness(webhook_urls=r.url, webhook_max_attempts=2, webhook_allow_private=True)
        run = h.create_run()
        h.send(run["id"], qkai_reports(0, [[0.9]] * 3))
        notifier = h.app.state.notifier
        for i in range(4):
            notifier.deliver_pending(now=10**10 + i * 10**6)  # each call past the previous backoff
        assert len(r.bodies) == 2
        assert h.store.notification_stats() == {"delivered": 0, "gave_up": 1, "pending": 0}
    finally:
        r.close()


def test_background_thread_delivers_when_woken(make_harness, receiver: Receiver):
    h = make_harness(
        webhook_urls=receiver.url, background=True, maintenance_interval_s=3600, webhook_allow_private=True
    )
    receiver.fail_first = 0
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))  # queues a notification and wakes the thread
    assert receiver.got.wait(30), "the maintenance thread did not deliver the notification"
    assert receiver.bodies[0]["alerts"][0]["labels"]["run_id"] == run["id"]


def test_a_run_that_ends_while_firing_is_told_as_firing_with_the_end_annotated(make_harness):
    """Finished with layer 0 collapsed: the notification stays "firing" (same fingerprint), says that the run
    ended while it fired, where, and with which value; when the run resumes and heals, the same alert resolves."""
    r = Receiver()
    try:
        h = make_harness(webhook_urls=r.url, webhook_allow_private=True)
        notifier = h.app.state.notifier
        run = h.create_run(attempt_key="first")
        h.send(run["id"], qkai_reports(0, [[0.9]] * 2 + [[0.934]]))
        assert notifier.deliver_pending() == 1
        fired = r.bodies[-1]["alerts"][0]
        patch = h.client.patch(f"/v1/runs/{run['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
        assert patch.status_code == 200, patch.text
        assert notifier.deliver_pending() == 1
        body = r.bodies[-1]
        ended = body["alerts"][0]
        assert body["status"] == ended["status"] == "firing"
        assert ended["fingerprint"] == fired["fingerprint"] and ended["endsAt"] == "0001-01-01T00:00:00Z"
        notes = ended["annotations"]
        assert (notes["run_ended"], notes["ended_step"], notes["last_values"]) == ("finished", "20", "0=0.934")
        assert notes["resolved_step"] == "" and "run_ended" not in ended["labels"]
        assert notes["summary"] == (
            "run ended while firing (run finished at step 20; last qkai: layer 0 = 0.934): "
            + fired["annotations"]["summary"]
        )
        assert notifier.deliver_pending() == 0  # told once

        h.create_run(run["name"], attempt_key="second")
        h.send(run["id"], qkai_reports(30, [[0.2]]), attempt=2)
        assert notifier.deliver_pending() == 1
        healed = r.bodies[-1]["alerts"][0]
        assert (r.bodies[-1]["status"], healed["fingerprint"]) == ("resolved", fired["fingerprint"])
        assert healed["annotations"]["resolved_step"] == "30" and "run_ended" not in healed["annotations"]
    finally:
        r.close()
