"""A batch's points into the ``points`` table, insert-or-ignore on their natural key.

:func:`insert_points` is called by :func:`qkwatch.monitor.store.values.ingest.write_batch` in its transaction:
on SQLite one prepared statement over the rows in key order, on PostgreSQL a binary COPY (a temporary
table and ``INSERT ... ON CONFLICT DO NOTHING`` when some points were stored before).
"""

from __future__ import annotations

import struct
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from qkwatch.monitor.store.engine import is_postgres

if TYPE_CHECKING:
    import psycopg  # for its types only: the postgres extra may not be installed

PointRow = tuple[str, int, int, int, float | None]
"""(metric, head, layer, step, value); a NaN value is None (see models)."""
PointParams = tuple[int, int, int, int, float | None]
"""A :data:`PointRow` with its metric's id: (metric id, head, layer, step, value)."""


def insert_points(conn: sa.Connection, run_pk: int, attempt: int, rows: list[PointRow], ids: dict[str, int]) -> int:
    """Insert-or-ignore ``rows`` (metric names mapped to ``ids``); returns how many were new."""
    if not rows:
        return 0
    if is_postgres(conn):
        return _insert_points_postgres(conn, run_pk, attempt, [(ids[m], h, la, s, v) for (m, h, la, s, v) in rows])
    params = [(run_pk, ids[m], h, s, la, attempt, v) for (m, h, la, s, v) in rows]
    params.sort(key=_KEY_ORDER)
    return _insert_points_sqlite(conn, params)


_KEY_ORDER = itemgetter(1, 2, 3, 4)
"""(metric id, head, step, layer): the points' key order within one run and attempt."""


def _insert_points_sqlite(conn: sa.Connection, params: list[tuple[int, int, int, int, int, int, float | None]]) -> int:
    # One prepared statement run over all rows (sqlite3's executemany, in C); its rowcount sums
    # the rows actually inserted, so ignored duplicates are not counted. ``params``: (run_pk,
    # metric id, head, step, layer, attempt, value) in key order, so that consecutive inserts land
    # on the same leaf page.
    result = conn.exec_driver_sql(
        "INSERT INTO points (run_pk, metric_id, head, step, layer, attempt, value) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        params,
    )
    return result.rowcount


def _insert_points_postgres(conn: sa.Connection, run_pk: int, attempt: int, rows: list[PointParams]) -> int:
    # Binary COPY straight into ``points`` under a savepoint: every row is new in all but a replay,
    # and it takes about half the time of the temporary table and ON CONFLICT (bench/RESULTS.md). A
    # point stored already (or twice in the batch) makes it fail with a unique violation, undone to
    # the savepoint; then the same payload goes into a temporary table and INSERT ... ON CONFLICT DO
    # NOTHING, whose rowcount is exactly the new rows. The temporary table empties itself at commit.
    from psycopg.errors import UniqueViolation  # here: the postgres extra may not be installed

    driver: psycopg.Connection[Any] | None = conn.connection.driver_connection
    assert driver is not None  # None only once the connection is closed; we are inside its transaction
    payload = _copy_payload(run_pk, attempt, rows)
    cursor = driver.cursor()
    try:
        cursor.execute("SAVEPOINT points_in")
        try:
            _copy(cursor, "points", payload)
            cursor.execute("RELEASE SAVEPOINT points_in")
            return len(rows)
        except UniqueViolation:
            cursor.execute("ROLLBACK TO SAVEPOINT points_in")
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS points_in (run_pk int, metric_id int, head int, layer int, "
            "step bigint, attempt int, value float8) ON COMMIT DELETE ROWS"
        )
        _copy(cursor, "points_in", payload)
        cursor.execute(
            f"INSERT INTO points ({_POINT_COLUMNS}) SELECT {_POINT_COLUMNS} FROM points_in ON CONFLICT DO NOTHING"
        )
        inserted: int = cursor.rowcount
        cursor.execute("RELEASE SAVEPOINT points_in")
        return inserted
    finally:
        cursor.close()


_POINT_COLUMNS = "run_pk, metric_id, head, layer, step, attempt, value"
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags 0, no header extension
_COPY_TRAILER = b"\xff\xff"
_POINT_ROW = struct.Struct(">hiiiiiiiiiqiiid")
"""A point in binary COPY: 7 fields, each (length, value), in the order of :data:`_POINT_COLUMNS`."""
_POINT_ROW_NULL = struct.Struct(">hiiiiiiiiiqiii")
"""The same with a NULL value (a NaN; length -1 and no bytes)."""


def _copy_payload(run_pk: int, attempt: int, rows: list[PointParams]) -> bytes:
    """``rows`` (metric id, head, layer, step, value) of the run and attempt as a binary COPY payload,
    packed here with one ``struct`` call a row (psycopg's ``write_row`` took several times as long)."""
    parts = [_COPY_HEADER]
    for m, h, la, st, v in rows:
        if v is None:
            parts.append(_POINT_ROW_NULL.pack(7, 4, run_pk, 4, m, 4, h, 4, la, 8, st, 4, attempt, -1))
        else:
            parts.append(_POINT_ROW.pack(7, 4, run_pk, 4, m, 4, h, 4, la, 8, st, 4, attempt, 8, v))
    parts.append(_COPY_TRAILER)
    return b"".join(parts)


def _copy(cursor: psycopg.Cursor[Any], table: str, payload: bytes) -> None:
    with cursor.copy(f"COPY {table} ({_POINT_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(payload)
