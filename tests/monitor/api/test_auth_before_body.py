"""Issue 21, M1: a request body is read only once the caller passed the route's auth.

FastAPI reads and parses a body before it runs the dependencies that check the token, so a caller
without a token could make the collector parse 4 MiB of JSON per request before its 401 (the red
team stalled ``/healthz`` for seconds that way). Here an unparseable body is the witness: parsed,
it would be a 422; refused first, it is a 401 or 403. The ASGI test goes further and shows that not
a byte of the body was asked for. The speed this buys is measured in ``bench/auth_flood.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import httpx
import pytest

from tests.live import LiveCollector
from tests.monitor.conftest import report

BODY_BYTES = 4 * 1024 * 1024 - 4096
"""Just under the collector's default body limit (4 MiB)."""


def unparseable(size: int = BODY_BYTES) -> bytes:
    """``size`` bytes that start like a report batch and are not JSON."""
    head = b'{"batch_id": "' + str(uuid.uuid4()).encode() + b'", "reports": ['
    return head + b"{" * (size - len(head))


def post(h, path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> httpx.Response:
    return h.client.request(method, path, content=body, headers={"content-type": "application/json", **(headers or {})})


def test_no_token_is_401_before_the_body_is_parsed(h):
    run = h.create_run()
    for path, method in ((f"/v1/runs/{run['id']}/reports", "POST"), ("/v1/runs", "POST")):
        r = post(h, path, unparseable(), method=method)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        assert r.headers["www-authenticate"] == "Bearer"
        r = post(h, path, unparseable(), {"Authorization": "Bearer qkw_unknown"}, method=method)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    for path, method in ((f"/v1/runs/{run['id']}", "PATCH"), (f"/v1/runs/{run['id']}/lambdas/overrides", "PUT")):
        assert post(h, path, unparseable(10_000), method=method).status_code == 401, path


def test_a_token_without_the_scope_is_403_before_the_body_is_parsed(h):
    run = h.create_run()
    read_only = h.headers("read")
    r = post(h, f"/v1/runs/{run['id']}/reports", unparseable(), read_only)
    assert r.status_code == 403 and "'ingest'" in r.json()["detail"], r.text[:200]
    r = post(h, "/v1/runs", unparseable(), read_only)
    assert r.status_code == 403 and "'ingest'" in r.json()["detail"], r.text[:200]
    r = post(h, f"/v1/runs/{run['id']}", unparseable(10_000), read_only, method="PATCH")
    assert r.status_code == 403 and "'ingest' or 'control'" in r.json()["detail"], r.text
    r = post(h, f"/v1/runs/{run['id']}/lambdas/overrides", unparseable(10_000), h.headers("ingest"), method="PUT")
    assert r.status_code == 403 and "'control'" in r.json()["detail"], r.text


def test_an_authorised_caller_still_gets_the_parse_errors_and_its_reports_stored(h):
    run = h.create_run()
    r = post(h, f"/v1/runs/{run['id']}/reports", unparseable(), h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid", r.text[:300]
    # A large body is parsed in a worker thread: the same strict rules (a bare NaN named by its field) ...
    reports = [report(s, {"qkai": [0.5] * 64}) for s in range(2000)]
    body = json.dumps({"batch_id": str(uuid.uuid4()), "reports": reports}).encode()
    assert len(body) > 256 * 1024
    bare = body.replace(b'"time": 1999.0', b'"time": NaN')
    r = post(h, f"/v1/runs/{run['id']}/reports", bare, h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reports", 1999, "time"], r.text[:300]
    # ... and the same answer to a good one.
    assert post(h, f"/v1/runs/{run['id']}/reports", body, h.headers("ingest")).json() == {
        "inserted": 2000 * 64,
        "duplicates": 0,
    }
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=63, max_points=5000)["steps"] == list(range(2000))


def test_the_body_of_a_refused_request_is_never_read(h):
    """Straight through ASGI: the app must answer 401/403 without calling ``receive`` once."""
    run = h.create_run()
    path = f"/v1/runs/{run['id']}/reports"

    async def call(headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
        received = 0
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            received += 1
            return {"type": "http.request", "body": unparseable(), "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"testserver"), *headers],
            "client": ("127.0.0.1", 1),
            "server": ("testserver", 80),
        }
        await h.app(scope, receive, send)
        return status, received

    assert anyio.run(call, []) == (401, 0)
    read_token = h.headers("read")["Authorization"].encode()
    assert anyio.run(call, [(b"authorization", read_token)]) == (403, 0)
    ingest_token = h.headers("ingest")["Authorization"].encode()
    status, received = anyio.run(call, [(b"authorization", ingest_token)])
    assert (status, received) == (422, 1)  # authorised: read, parsed, and refused as not JSON


@pytest.mark.parametrize("scopes", [(), ("read",)])
def test_a_real_collector_answers_a_4_mib_body_without_a_valid_token_and_keeps_the_connection(tmp_path, scopes):
    """Over a real socket: the 401/403 arrives whole while the client is still sending, and the
    connection serves the next request (uvicorn drains the unread body instead of resetting)."""
    live = LiveCollector(tmp_path, open_access=False)
    headers = {"content-type": "application/json"}
    if scopes:
        headers["authorization"] = f"Bearer {live.token(*scopes)}"
    with live, httpx.Client(base_url=live.url, timeout=30) as client:
        for _ in range(3):
            r = client.post(f"/v1/runs/{uuid.uuid4().hex}/reports", content=unparseable(), headers=headers)
            assert r.status_code == (403 if scopes else 401), r.text[:200]
        assert client.get("/healthz").json()["status"] == "ok"


def test_the_thread_parse_reads_json_as_the_inline_one():
    """Large bodies go through a Python object hook in a worker thread; the data must not change."""
    from qkwatch.monitor.api.strict_json import parse_strict

    doc = b'{"a": [1, 2.5, "x", null, true, {"b": {}, "b": [], "c": {"d": -0.0}}], "e": {}, "a2": 1e308}'
    assert parse_strict(doc, in_thread=True) == parse_strict(doc) == json.loads(doc)
    assert parse_strict(b"[[], {}, 1]", in_thread=True) == [[], {}, 1]
