"""Engines for the two supported databases, with the connection settings each one needs.

SQLite (the embedded default) runs in WAL mode, so readers never block the writer, with a busy
timeout, so concurrent writers (several uvicorn workers) wait instead of failing. The driver's
own transaction handling is switched off and we emit ``BEGIN`` ourselves: a write transaction
starts with ``BEGIN IMMEDIATE`` (``execution_options(write=True)``), which takes the write lock up
front rather than failing to upgrade a read lock half-way through (SQLITE_BUSY without retry).
Foreign keys are enforced, as on PostgreSQL.

An open SQLite connection keeps working on its file after the file is deleted (or replaced) at its
path: what it writes goes to an unlinked file, lost when the last connection closes. So a file
database's engine remembers the file's device and inode at its first connection
(:class:`_FileGuard`), and refuses to hand out a connection once the path holds another file or
none (:class:`DatabaseFileGone`, an ``OperationalError``: the API answers 503, and agents keep
their spools), and :func:`check_file` tells a write that committed into a file that is gone.
"""

from __future__ import annotations

import os
import sqlite3
import weakref
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool

_GUARDS: weakref.WeakKeyDictionary[Engine, _FileGuard] = weakref.WeakKeyDictionary()
"""The file guard of each SQLite file engine."""


class DatabaseFileGone(sqlite3.OperationalError):
    """The SQLite file the engine opened is no longer at its path: deleted, or replaced by another file.

    Until the collector restarts (on whatever file is at the path then), no connection is handed out.
    """


class _FileGuard:
    """The (device, inode) of a SQLite database file as the engine first opened it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.identity: tuple[int, int] | None = None

    def note(self) -> None:
        """Called on each new connection: the first one fixes the file the engine works on."""
        if self.identity is None:
            st = os.stat(self.path)
            self.identity = (st.st_dev, st.st_ino)

    def check(self) -> None:
        """Raise :class:`DatabaseFileGone` when the path no longer holds the file first opened."""
        if self.identity is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise DatabaseFileGone(
                f"the database file {self.path} was deleted while the collector had it open; "
                "put it back (or not) and restart the collector"
            ) from None
        if (st.st_dev, st.st_ino) != self.identity:
            raise DatabaseFileGone(
                f"the database file {self.path} was replaced by another file while the collector had it open; "
                "restart the collector to use the new one"
            )


def check_file(engine: Engine) -> None:
    """After a write committed: raise when the SQLite file it went into is no longer at its path.

    The write is lost with that file, so it must not be acknowledged: the ``OperationalError`` is
    answered 503, and the agent sends the batch again later (stored once, by its batch id).
    No-op for PostgreSQL and in-memory SQLite.
    """
    guard = _GUARDS.get(engine)
    if guard is None:
        return
    try:
        guard.check()
    except DatabaseFileGone as exc:
        raise sa.exc.OperationalError("COMMIT", None, exc) from None


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
    if not memory and not url.query.get("uri"):
        _guard_file(engine, os.path.abspath(str(url.database)))

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
        cursor.execute("PRAGMA foreign_keys=ON")  # off unless asked for, on each connection
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("write") else "BEGIN")

    return engine


def _guard_file(engine: Engine, path: str) -> None:
    """Hand out connections to ``path`` only while it holds the file the engine first opened."""
    guard = _GUARDS[engine] = _FileGuard(path)

    @event.listens_for(engine, "do_connect")
    def _open_existing(_dialect: Any, _record: ConnectionPoolEntry, cargs: list[Any], cparams: dict[str, Any]) -> None:
        if guard.identity is not None:
            guard.check()
            # Read-write, never create: sqlite3 would otherwise make an empty file where ours was.
            cargs[0] = f"file:{quote(path)}?mode=rw"
            cparams["uri"] = True

    @event.listens_for(engine, "connect")
    def _note(_dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        guard.note()

    @event.listens_for(engine, "checkout")
    def _check(_dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry, _proxy: Any) -> None:
        guard.check()
