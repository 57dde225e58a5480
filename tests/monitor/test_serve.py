"""A real ``qkwatch serve`` (uvicorn) on a free loopback port, driven through ``qkwatch.client.Client``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from qkwatch.client.rest import Client, CollectorError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qkwatch(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs
    )


def wait_healthy(url: str, tries: int = 300) -> bool:
    """Poll /healthz (worker processes may still be starting after the parent's banner)."""
    for _ in range(tries):
        try:
            if httpx.get(f"{url}/healthz", timeout=5).json()["status"] == "ok":
                return True
        except httpx.HTTPError:
            time.sleep(0.1)
    return False


@contextmanager
def serve(*args: str) -> Iterator[str]:
    """Start ``qkwatch serve ARGS`` and yield its URL once /healthz answers; stop it afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkwatch.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        for line in proc.stdout:  # bounded by the process: it either listens or exits
            lines.append(line)
            if "Uvicorn running on" in line or "Application startup complete" in line:
                break
        else:
            raise AssertionError("qkwatch serve exited:\n" + "".join(lines))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        assert any(f"listening on {url}" in line for line in lines), "".join(lines)
        assert wait_healthy(url), "".join(lines)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_open_server_through_the_client(db_url: str):
    with serve("--open", "--database-url", db_url) as url, Client(url) as c:
        project = f"srv-{uuid.uuid4().hex[:8]}"
        run = c.create_run(project, "r1", config={"n_layers": 3}, attempt_key="k1")
        assert run["attempt"] == 1 and run["status"] == "running"
        reports = [
            {"step": s, "time": float(s), "layers": {"qkai": [0.2, 0.9, "nan"], "attn_entropy": [0.8] * 3}}
            for s in range(0, 40, 10)
        ]
        batch = str(uuid.uuid4())
        assert c.send_reports(run["id"], reports, batch_id=batch) == {"inserted": 24, "duplicates": 0}
        assert c.send_reports(run["id"], reports, batch_id=batch) == {"inserted": 0, "duplicates": 24}
        assert c.series(run["id"], "qkai", layer=2)["values"] == ["nan"] * 4
        assert c.heatmap(run["id"], max_steps=2)["values"] == [[0.2, 0.9, "nan"]] * 2
        other = c.create_run(project, "r2")
        c.send_reports(other["id"], [{"step": 0, "time": 0.0, "layers": {"qkai": [0.1]}}])
        compared = c.compare([run["id"], other["id"]], "qkai", layer=0)
        assert [s["values"] for s in compared["series"]] == [[0.2] * 4, [0.1]]
        lines = list(c.export(run["id"], format="csv"))
        assert lines[0] == "attempt,step,metric,layer,head,value" and len(lines) == 1 + 24
        lam = c.lambdas(run["id"])
        assert lam["version"] == 1 and len(lam["lambdas"]) == 3 and lam["step"] == 30
        assert c.set_overrides(run["id"], {1: 0.0})["lambdas"][1] == 0.0
        assert c.lambdas_audit(run["id"])["data"][0]["new"] == 0.0
        firing = c.alerts(run=run["id"], state="firing")["data"]
        assert [a["layers"] for a in firing] == [[1]]
        assert c.set_status(run["id"], "finished")["status"] == "finished"
        with pytest.raises(CollectorError) as err:
            c.set_overrides(run["id"], {7: 0.5})
        assert err.value.status == 422 and "out of range" in err.value.message
        c.delete_run(other["id"])
        with pytest.raises(CollectorError) as err:
            c.run(other["id"])
        assert err.value.status == 404
        page = httpx.get(f"{url}/", timeout=10)
        assert page.status_code == 200 and 'src="ui/plotly.min.js"' in page.text
        script = httpx.get(f"{url}/ui/plotly.min.js", timeout=30)  # served locally: the page needs no internet
        assert script.status_code == 200 and len(script.content) > 1_000_000
        cached = httpx.get(f"{url}/ui/plotly.min.js", headers={"If-None-Match": script.headers["etag"]})
        assert cached.status_code == 304
        assert "qkwatch_points_ingested_total" in httpx.get(f"{url}/metrics", timeout=10).text


def test_tokens_from_the_cli_guard_the_server(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'auth.db'}"
    made = qkwatch(
        "token",
        "create",
        "--project",
        "p",
        "--scope",
        "ingest",
        "--scope",
        "read",
        "--name",
        "agent",
        "--database-url",
        db,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("qkw_") and "shown only this once" in made.stderr
    with serve("--database-url", db) as url:
        with Client(url) as anonymous, pytest.raises(CollectorError) as err:
            anonymous.runs()
        assert err.value.status == 401
        with Client(url, token=token) as c:
            run = c.create_run("p", "r")
            with pytest.raises(CollectorError) as err:
                c.create_run("q", "r")
            assert err.value.status == 403
            with pytest.raises(CollectorError) as err:
                c.set_overrides(run["id"], {0: 0.1})
            assert err.value.status == 403  # no control scope
    listed = qkwatch("token", "list", "--database-url", db)
    assert "agent" in listed.stdout and token not in listed.stdout


def test_open_mode_is_refused_off_loopback(tmp_path: Path):
    result = qkwatch(
        "serve",
        "--open",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--database-url",
        f"sqlite:///{tmp_path / 'x.db'}",
    )
    assert result.returncode == 2 and "loopback" in result.stderr


def test_db_upgrade_is_idempotent(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'up.db'}"
    for _ in range(2):
        result = qkwatch("db", "upgrade", "--database-url", db)
        assert result.returncode == 0 and "up to date" in result.stdout, result.stderr


def test_two_workers_store_concurrent_batches_once(db_url: str):
    """Two uvicorn workers on one database (SQLite: WAL + busy timeout), eight threads posting with replays."""
    with serve("--open", "--workers", "2", "--database-url", db_url) as url, Client(url) as c:
        run = c.create_run(f"p-{uuid.uuid4().hex[:8]}", "busy")
        batches = [
            (str(uuid.uuid4()), [{"step": b * 10 + i, "time": 0.0, "layers": {"qkai": [0.3] * 24}} for i in range(10)])
            for b in range(16)
        ]
        results: list[dict] = []

        def post(chunk) -> None:
            with Client(url) as own:
                for batch_id, reports in chunk:
                    results.append(own.send_reports(run["id"], reports, batch_id=batch_id))
                    results.append(own.send_reports(run["id"], reports, batch_id=batch_id))  # a retry

        threads = [threading.Thread(target=post, args=(batches[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sum(r["inserted"] for r in results) == 16 * 10 * 24
        assert sum(r["duplicates"] for r in results) == 16 * 10 * 24
        assert len(c.series(run["id"], "qkai", layer=23, max_points=1000)["steps"]) == 160
