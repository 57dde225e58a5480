"""Engines for the two supported databases, with the connection settings each one needs.

SQLite (the embedded default) runs in WAL mode, so readers never block the writer, with a busy
timeout, so concurrent writers (several uvicorn workers) wait instead of failing. The driver's
own transaction handling is switched off and we emit ``BEGIN`` ourselves: a write transaction
starts with ``BEGIN IMMEDIATE`` (``execution_options(write=True)``), which takes the write lock up
front rather than failing to upgrade a read lock half-way through (SQLITE_BUSY without retry).
"""

from __future__ import annotations

import sqlite3
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool


def make_engine(url: str, *, busy_timeout_ms: int = 10_000) -> Engine:
    """An engine for ``sqlite:///...`` or ``postgresql[+psycopg]://...``."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(parsed, busy_timeout_ms)
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=8)
    raise ValueError(f"unsupported database {backend!r}: use sqlite:///PATH or postgresql://...")


def is_postgres(engine: Engine | sa.Connection) -> bool:
    return engine.dialect.name == "postgresql"


def _sqlite_engine(url: sa.URL, busy_timeout_ms: int) -> Engine:
    memory = url.database in (None, "", ":memory:")
    kwargs: dict[str, Any] = {"connect_args": {"timeout": busy_timeout_ms / 1000, "check_same_thread": False}}
    if memory:  # one shared in-memory database for all threads
        kwargs["poolclass"] = StaticPool
    engine = sa.create_engine(url, **kwargs)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see _begin)
        cursor = dbapi_connection.cursor()
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        # NORMAL is durable across application crashes in WAL mode; only an OS crash or power
        # loss can lose the last transactions, and the agent retries what was not acknowledged.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("write") else "BEGIN")

    return engine
