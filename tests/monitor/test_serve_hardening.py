"""``qkwatch serve`` refuses what it cannot run safely, in one line, before it listens; a real uvicorn
keeps its keep-alive connections usable after a 5xx (issue 10, items 1, 8 and 9)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
import uvicorn

from qkwatch.monitor.main import create_app
from tests.monitor.conftest import make_settings
from tests.monitor.test_serve import ROOT, free_port, serve

pytestmark = pytest.mark.slow


def refused(*args: str, env: dict | None = None) -> str:
    """Run ``qkwatch serve ARGS`` expecting exit status 2 before listening; returns its one line of stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "serve", "--port", str(free_port()), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "listening" not in result.stdout, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- 1. open mode off loopback ------------------------------------------------------------------


def test_open_mode_from_the_environment_is_refused_off_loopback(tmp_path: Path):
    line = refused(
        "--host", "0.0.0.0", "--database-url", f"sqlite:///{tmp_path / 'x.db'}", env={"QKWATCH_OPEN_ACCESS": "true"}
    )
    assert "loopback" in line and "QKWATCH_OPEN_ACCESS" in line


# --- 9. start-up errors are one clear line --------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("notadb://nowhere", "notadb"),
        ("sqlite:////nonexistent-dir/sub/x.db", "database"),
        ("postgresql://postgres@127.0.0.1:1/nope", "127.0.0.1"),
    ],
)
def test_a_bad_database_url_is_one_line(url: str, expect: str):
    line = refused("--database-url", url)
    assert line.startswith("qkwatch serve:") and expect in line, line


def test_a_password_in_a_bad_database_url_is_not_printed():
    line = refused("--database-url", "postgresql://postgres:hunter2@127.0.0.1:1/nope")
    assert "hunter2" not in line, line


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("rules: 5\n", "list"),
        ("", "rules: []"),
        ("webhooks: [http://hook.example]\n", "rules: []"),
        ("rules:\n  - {name: r, metric: qkai, op: '>', threshold: 0.7, for_reports: 2.5}\n", "for_reports"),
        ("rules:\n  - {name: r, metric: qkai, op: '>', threshold: true, for_reports: 2}\n", "threshold"),
        ('rules:\n  - {name: r, metric: "bad metric!", threshold: 0.7}\n', "metric"),
        ("rules: [\n", "YAML"),
        ("rules: []\nwebhooks: 5\n", "webhooks"),
    ],
)
def test_a_bad_rules_file_is_one_line_before_listening(tmp_path: Path, text: str, expect: str):
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    line = refused("--database-url", f"sqlite:///{tmp_path / 'x.db'}", "--rules", str(rules))
    assert str(rules) in line and expect in line, line
    assert not (tmp_path / "x.db").exists()  # validated before the database is touched


def test_a_missing_rules_file_is_one_line(tmp_path: Path):
    line = refused(
        "--database-url",
        f"sqlite:///{tmp_path / 'x.db'}",
        env={"QKWATCH_ALERT_RULES_FILE": str(tmp_path / "absent.yaml")},
    )
    assert "absent.yaml" in line, line


def test_a_bad_setting_is_one_line(tmp_path: Path):
    line = refused("--database-url", f"sqlite:///{tmp_path / 'x.db'}", env={"QKWATCH_RATE_LIMIT_PER_S": "fast"})
    assert "rate_limit_per_s" in line.lower(), line


# --- 8. keep-alive connections after a 5xx ----------------------------------------------------------


def _request(sock: socket.socket, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a kept-alive connection; the whole response."""
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: keep-alive\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"the server closed the connection (after {data!r})")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        body += chunk
    return int(status_line.split()[1]), headers, body


def _usable_after(sock: socket.socket, status: int, headers: dict[str, str]) -> None:
    """After a 5xx the connection is either announced closed or still answers."""
    assert status >= 500
    if headers.get("connection", "").lower() == "close":
        return
    assert _request(sock, "GET", "/ui/config.json")[0] == 200


def test_a_broken_database_answers_503_json_and_keeps_the_connection(isolated_db_url: str):
    with serve("--open", "--database-url", isolated_db_url) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            assert _request(sock, "GET", "/v1/runs")[0] == 200
            engine = sa.create_engine(isolated_db_url.replace("postgresql://", "postgresql+psycopg://"))
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    "DROP TABLE runs CASCADE" if engine.dialect.name == "postgresql" else "DROP TABLE runs"
                )
            engine.dispose()
            status, headers, body = _request(sock, "GET", "/v1/runs")
            assert status == 503 and headers["content-type"] == "application/json", (status, headers, body)
            assert json.loads(body)["detail"] and int(headers["retry-after"]) >= 1
            _usable_after(sock, status, headers)


def test_an_unexpected_error_is_a_json_500_and_keeps_the_connection(sqlite_url: str):
    app = create_app(make_settings(sqlite_url, open_access=True))

    def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            status, headers, body = _request(sock, "GET", "/boom")
            assert status == 500 and headers["content-type"] == "application/json", (headers, body)
            assert "a bug" not in body.decode() and json.loads(body)["detail"]
            _usable_after(sock, status, headers)
    finally:
        server.should_exit = True
        thread.join(30)
