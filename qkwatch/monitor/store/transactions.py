"""The store's transactions: every method of the store runs in one, and a snapshot holds several reads.

A write (:meth:`Transactions._write`) commits whole or not at all, and is not acknowledged when
its SQLite file was deleted meanwhile (the commit is lost). A read (:meth:`Transactions._read`)
sees one snapshot of the database, on PostgreSQL as on SQLite, so that two statements of one read
never pair rows of two commits. A route that reads a run and then its values takes one read transaction for all of
them with :meth:`Transactions.snapshot`, whose :class:`Snapshot` has the same read methods as the
:class:`~qkwatch.monitor.store.store.Store` (one pool checkout, one snapshot of the database).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine

from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import check_file, is_postgres
from qkwatch.monitor.store.runs import lookup
from qkwatch.monitor.store.values import history, reads
from qkwatch.monitor.store.values.history import Doubles


class Transactions:
    """The engine and the transactions on it: the base of :class:`~qkwatch.monitor.store.store.Store`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._closed = False
        # A read is one snapshot of the database, as SQLite's WAL gives a read transaction. PostgreSQL's
        # READ COMMITTED takes a snapshot per statement, so a read in two statements (the run row, then
        # its running entropies) could pair rows of two commits: one lambda version served with two
        # sets of lambdas by two replicas (found by bench/fleet.py). REPEATABLE READ holds the first
        # statement's snapshot; a transaction that only reads never fails to serialise.
        self._read_options: dict[str, str] = {"isolation_level": "REPEATABLE READ"} if is_postgres(engine) else {}

    def close(self) -> None:
        """Dispose of the connection pool; idempotent."""
        if not self._closed:
            self._closed = True
            self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with self.engine.connect().execution_options(write=True) as conn, conn.begin():
            yield conn
        check_file(self.engine)  # committed into a SQLite file deleted meanwhile: lost, so not acknowledged

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        """A read-only transaction on one snapshot of the database (see ``__init__``)."""
        with self.engine.connect().execution_options(**self._read_options) as conn, conn.begin():
            yield conn

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """Several reads in one read-only transaction: one connection, one snapshot of the database.

        For a request that reads a run and then its values (``GET /history``): one checkout of
        the pool and one transaction instead of one per read.
        """
        with self._read() as conn:
            yield Snapshot(conn)

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at; None when it has none (an empty database)."""
        with self._read() as conn:
            return MigrationContext.configure(conn).get_current_revision()


class Snapshot:
    """Reads on one read-only transaction (:meth:`Transactions.snapshot`); the same answers as the Store's
    methods of the same names, which each open their own."""

    def __init__(self, conn: sa.Connection) -> None:
        self._conn = conn

    def get_run(self, run_id: str) -> m.RunRow:
        """The run ``run_id``.

        Raises:
            NotFound: no such run.
        """
        return lookup.by_id(self._conn, run_id)

    def get_run_by_name(self, project: str, name: str) -> m.RunRow:
        """The run ``project/name``.

        Raises:
            NotFound: no such run.
        """
        return lookup.by_name(self._conn, project, name)

    def run_metrics(self, run: m.RunRow) -> dict[str, list[int]]:
        """Metric name -> layers that reported it (``[-1]`` for a run-level scalar)."""
        return reads.run_metrics(self._conn, run)

    def history_doubles(
        self,
        run: m.RunRow,
        metrics: Sequence[str],
        *,
        start: int | None = None,
        end: int | None = None,
        attempt: int | None = None,
        max_points: int | None = None,
    ) -> dict[str, Doubles]:
        """:meth:`Store.history` as float64 bytes: per metric (steps, layers, values, measured).

        See :func:`qkwatch.monitor.store.values.history.doubles`.
        """
        return history.doubles(self._conn, run, metrics, start, end, attempt, max_points)
