"""Fixtures of the collector's tests: real databases (SQLite and PostgreSQL), real apps.

``db_url`` is parametrised over both databases. PostgreSQL gets a fresh database per test session
(``qkwatch_test_<random>``, dropped at the end) at ``$QKWATCH_TEST_PG`` (default: the local
server); when it is unreachable the PostgreSQL variants skip locally and fail under CI=true.
Runs are isolated per test by a unique project name, since one PostgreSQL database serves the
whole session.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from qkwatch.monitor.main import create_app
from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.store import Store
from tests.conftest import missing_service

PG_ADMIN_URL = os.environ.get("QKWATCH_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str | None]:
    """A fresh, migrated PostgreSQL database for the session, or None when the server is absent."""
    admin = _pg_admin()
    if admin is None:
        yield None
        return
    yield from _fresh_database(admin)


def _pg_admin() -> sa.Engine | None:
    try:
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return admin
    except Exception:
        return None


def _fresh_database(admin: sa.Engine) -> Iterator[str]:
    """Create and migrate ``qkwatch_test_<random>``, yield its URL, drop it afterwards."""
    name = f"qkwatch_test_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def isolated_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Like ``db_url``, but a database of its own on PostgreSQL too (for tests that see every run)."""
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    admin = _pg_admin()
    if admin is None:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    yield from _fresh_database(admin)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'collector.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database URL: a fresh SQLite file, or the session's PostgreSQL database."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    url = request.getfixturevalue("pg_url")
    if url is None:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    return url


@dataclass
class Harness:
    """An app on a real database, a TestClient, and tokens of each scope for one fresh project."""

    client: TestClient
    store: Store
    project: str
    tokens: dict[str, str]
    app: object

    def headers(self, *scopes: str) -> dict[str, str]:
        key = ",".join(sorted(scopes or ("ingest", "read", "control")))
        if key not in self.tokens:
            _, secret = self.store.create_token(self.project, key.split(","), name=f"test-{key}")
            self.tokens[key] = secret
        return {"Authorization": f"Bearer {self.tokens[key]}"}

    def create_run(self, name: str | None = None, config: dict | None = None, attempt_key: str | None = None) -> dict:
        body = {
            "project": self.project,
            "name": name or f"run-{uuid.uuid4().hex[:8]}",
            "config": config or {},
            "attempt_key": attempt_key,
        }
        r = self.client.post("/v1/runs", json=body, headers=self.headers("ingest"))
        assert r.status_code == 200, r.text
        return r.json()

    def send(
        self,
        run_id: str,
        reports: list[dict],
        batch_id: str | None = None,
        attempt: int | None = None,
        expect: int = 200,
    ) -> dict:
        body = {"batch_id": batch_id or str(uuid.uuid4()), "reports": reports}
        if attempt is not None:
            body["attempt"] = attempt
        r = self.client.post(f"/v1/runs/{run_id}/reports", json=body, headers=self.headers("ingest"))
        assert r.status_code == expect, r.text
        return r.json()

    def get(self, path: str, expect: int = 200, **params) -> dict:
        r = self.client.get(path, params=params, headers=self.headers("read"))
        assert r.status_code == expect, r.text
        return r.json()


def make_settings(db_url: str, **overrides) -> Settings:
    return Settings(**{"database_url": db_url, "auto_migrate": False, "background": False, **overrides})


@pytest.fixture
def make_harness(db_url: str) -> Iterator:
    """Factory: ``make_harness(**settings_overrides)`` -> Harness (closed at the end of the test).

    A module whose tests must see only their own runs overrides ``db_url`` with ``isolated_db_url``.
    """
    opened = []

    def make(**overrides) -> Harness:
        app = create_app(make_settings(db_url, **overrides))
        client = TestClient(app)
        client.__enter__()
        opened.append(client)
        return Harness(
            client=client, store=app.state.store, project=f"proj-{uuid.uuid4().hex[:10]}", tokens={}, app=app
        )

    yield make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def h(make_harness) -> Harness:
    return make_harness()


def report(step: int, layers: dict | None = None, **extra) -> dict:
    """A report at ``step`` (time = step, so tests stay deterministic)."""
    return {"step": step, "time": float(step), "layers": layers or {}, **extra}
