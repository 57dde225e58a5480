"""``qkwatch dashboards push`` against a stand-in Grafana, through the real grafana-client.

Grafana itself cannot run here (it is in neither Debian's archive nor PyPI), so ``FakeGrafana`` is
a real HTTP server on a loopback port that implements just the endpoints grafana-client calls for
a push (folders, dashboards by uid, data sources by uid), keeps what it is sent the way Grafana
does (ids, versions, passwords write-only), and records every request. The push must create
everything once, write nothing on a second push, and rewrite only what someone changed since.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qkwatch.cli import main
from qkwatch.dashboards.push import FOLDER_UID, POSTGRES_UID, PROMETHEUS_UID, load_dashboards
from tests.live import free_port

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = load_dashboards(ROOT / "qkwatch" / "dashboards" / "grafana" / "dashboards")


class FakeGrafana:
    """The slice of Grafana's HTTP API that a push uses, in memory, recording requests."""

    def __init__(self) -> None:
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.datasources: dict[str, dict] = {}
        self.passwords: dict[str, str | None] = {}
        """The last password each data source was sent (Grafana never answers it back)."""
        self.requests: list[tuple[str, str, str | None, dict | None]] = []
        self._ids = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-grafana", daemon=True)
        self._thread.start()

    def writes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.requests if method != "GET"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def answer(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        parts = path.strip("/").split("/")  # api, resource, ...
        match method, parts[1:]:
            case "GET", ["folders", uid]:
                return (200, self.folders[uid]) if uid in self.folders else (404, {"message": "folder not found"})
            case "POST", ["folders"]:
                folder = {"id": self._next_id(), "uid": body["uid"], "title": body["title"], "version": 1}
                self.folders[body["uid"]] = folder
                return 200, folder
            case "PUT", ["folders", uid]:
                self.folders[uid].update(title=body["title"], version=self.folders[uid]["version"] + 1)
                return 200, self.folders[uid]
            case "GET", ["dashboards", "uid", uid]:
                if uid not in self.dashboards:
                    return 404, {"message": "Dashboard not found"}
                return 200, copy.deepcopy(self.dashboards[uid])
            case "POST", ["dashboards", "db"]:
                return self._save_dashboard(body)
            case "GET", ["datasources", "uid", uid]:
                if uid not in self.datasources:
                    return 404, {"message": "Data source not found"}
                return 200, copy.deepcopy(self.datasources[uid])
            case "POST", ["datasources"]:
                source = self._keep_datasource(body, {"id": self._next_id(), "version": 1})
                return 200, {"datasource": source, "id": source["id"], "message": "Datasource added"}
            case "PUT", ["datasources", "uid", uid]:
                old = self.datasources[uid]
                source = self._keep_datasource(body, {"id": old["id"], "version": old["version"] + 1}, old)
                return 200, {"datasource": source, "id": source["id"], "message": "Datasource updated"}
        return 404, {"message": f"not implemented by the fake: {method} {path}"}

    def _save_dashboard(self, body: dict) -> tuple[int, dict]:
        board = copy.deepcopy(body["dashboard"])
        old = self.dashboards.get(board["uid"])
        if old is not None and not body.get("overwrite"):
            return 412, {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"}
        if body.get("folderUid") not in self.folders:
            return 400, {"message": "folder not found"}
        board["id"] = old["dashboard"]["id"] if old else self._next_id()
        board["version"] = old["dashboard"]["version"] + 1 if old else 1
        self.dashboards[board["uid"]] = {
            "dashboard": board,
            "meta": {"folderUid": body["folderUid"], "slug": board["uid"]},
        }
        return 200, {"id": board["id"], "uid": board["uid"], "status": "success", "version": board["version"]}

    def _keep_datasource(self, body: dict, ids: dict, old: dict | None = None) -> dict:
        """Stored as Grafana does: secrets write-only (only ``secureJsonFields`` says they are set)."""
        secret = dict((old or {}).get("secureJsonFields", {}))
        secret.update({k: True for k in body.get("secureJsonData", {})})
        source = {k: v for k, v in body.items() if k not in ("secureJsonData", "version")}
        source.update(ids, secureJsonFields=secret, readOnly=False, orgId=1)
        self.datasources[body["uid"]] = source
        if "secureJsonData" in body:
            self.passwords[body["uid"]] = body["secureJsonData"].get("password")
        return source

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((self.command, self.path, self.headers.get("Authorization"), body))
                status, answer = fake.answer(self.command, self.path.split("?")[0], body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _serve

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana()
    yield fake
    fake.close()


def push(grafana: FakeGrafana, *extra: str) -> int:
    return main(
        [
            "dashboards",
            "push",
            "--grafana-url",
            grafana.url,
            "--postgres",
            "db.internal:5432",
            "--prometheus-url",
            "http://prom.internal:9090",
            *extra,
        ]
    )


def test_push_creates_everything_then_a_second_push_writes_nothing(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_test")
    monkeypatch.setenv("QKWATCH_GRAFANA_DB_PASSWORD", "s3cret")
    assert push(grafana) == 0
    assert sorted(grafana.writes()) == sorted(
        [
            ("POST", "/api/folders"),
            ("POST", "/api/datasources"),
            ("POST", "/api/datasources"),
            ("POST", "/api/dashboards/db"),
            ("POST", "/api/dashboards/db"),
        ]
    )
    assert {auth for _, _, auth, _ in grafana.requests} == {"Bearer glsa_test"}
    assert grafana.folders[FOLDER_UID]["title"] == "qkwatch"
    for board in COMMITTED:
        stored = grafana.dashboards[board["uid"]]
        assert stored["meta"]["folderUid"] == FOLDER_UID
        assert {k: v for k, v in stored["dashboard"].items() if k not in ("id", "version")} == board
    postgres, prometheus = grafana.datasources[POSTGRES_UID], grafana.datasources[PROMETHEUS_UID]
    assert (postgres["url"], postgres["user"], postgres["jsonData"]["database"]) == (
        "db.internal:5432",
        "qkwatch_grafana",
        "qkwatch",
    )
    assert postgres["secureJsonFields"] == {"password": True} and grafana.passwords[POSTGRES_UID] == "s3cret"
    assert prometheus["url"] == "http://prom.internal:9090"
    assert "5 of 5 objects written" in capsys.readouterr().out

    grafana.requests.clear()
    assert push(grafana) == 0
    assert grafana.writes() == []
    out = capsys.readouterr().out
    assert out.count("unchanged") == 5 and "0 of 5 objects written" in out
    assert [d["dashboard"]["version"] for d in grafana.dashboards.values()] == [1, 1]


def test_push_rewrites_only_what_changed_in_grafana(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_test")
    assert push(grafana) == 0
    grafana.dashboards["qkwatch-runs"]["dashboard"]["title"] = "edited in the UI"
    grafana.datasources[PROMETHEUS_UID]["url"] = "http://elsewhere:9090"
    grafana.requests.clear()
    assert push(grafana) == 0
    assert sorted(grafana.writes()) == [
        ("POST", "/api/dashboards/db"),
        ("PUT", f"/api/datasources/uid/{PROMETHEUS_UID}"),
    ]
    assert grafana.dashboards["qkwatch-runs"]["dashboard"]["title"] == "qkwatch / runs"
    assert grafana.dashboards["qkwatch-runs"]["dashboard"]["version"] == 2
    assert grafana.datasources[PROMETHEUS_UID]["url"] == "http://prom.internal:9090"
    assert "2 of 5 objects written" in capsys.readouterr().out


def test_push_with_basic_auth_and_dashboards_only(grafana, monkeypatch):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    monkeypatch.setenv("GRAFANA_PASSWORD", "pw")
    assert push(grafana, "--user", "admin", "--no-datasources") == 0
    expected = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert {auth for _, _, auth, _ in grafana.requests} == {expected}
    assert grafana.datasources == {} and set(grafana.dashboards) == {b["uid"] for b in COMMITTED}


def test_push_without_a_grafana_url_says_so(monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    assert main(["dashboards", "push"]) == 2
    assert "--grafana-url" in capsys.readouterr().err


def test_push_to_nothing_fails_with_a_message(capsys):
    assert main(["dashboards", "push", "--grafana-url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "qkwatch dashboards push:" in capsys.readouterr().err
