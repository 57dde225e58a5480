"""SQL helpers that know the dialect: insert-or-ignore, upsert, and how a NaN is stored.

Both databases speak ``INSERT ... ON CONFLICT``; SQLAlchemy spells it per dialect, and a bulk
upsert is fastest written by hand (PostgreSQL: one statement over ``unnest`` arrays).
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from qkwatch.monitor.store.engine import is_postgres


def insert(conn: sa.Connection, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT of ``table``, which has ``on_conflict_do_nothing`` (and ``_do_update``)."""
    return (postgresql.insert if is_postgres(conn) else sqlite.insert)(table)


# PostgreSQL array types of our column types, most specific first (BigInteger is an Integer).
_PG_ARRAY = (
    (sa.BigInteger, "int8"),
    (sa.Integer, "int4"),
    (sa.Float, "float8"),
    (sa.Boolean, "bool"),
    (sa.LargeBinary, "bytea"),
    (sa.String, "text"),
)


def _pg_array_type(column: sa.Column[Any]) -> str:
    return next(name for kind, name in _PG_ARRAY if isinstance(column.type, kind))


def upsert(
    conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]], *, update: bool = True, where: str | None = None
) -> None:
    """Insert rows; on a primary-key conflict update the other columns (``update``) or do nothing.

    ``where`` (SQL over ``t`` = the stored row and ``excluded``) restricts which conflicting rows
    are updated. PostgreSQL gets one statement for all rows (arrays through ``unnest``); SQLite
    an executemany, which is just as fast there.
    """
    if not rows:
        return
    cols = list(rows[0])
    keys = [c.name for c in table.primary_key.columns]
    params: dict[str, list[Any]] | list[tuple[Any, ...]]
    if is_postgres(conn):
        arrays = ", ".join(f"%({c})s::{_pg_array_type(table.c[c])}[]" for c in cols)
        sql = f"INSERT INTO {table.name} AS t ({', '.join(cols)}) SELECT * FROM unnest({arrays})"
        params = {c: [r[c] for r in rows] for c in cols}
    else:
        sql = f"INSERT INTO {table.name} AS t ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        params = [tuple(r[c] for c in cols) for r in rows]
    sql += f" ON CONFLICT ({', '.join(keys)}) "
    if update:
        sql += "DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in cols if c not in keys)
        sql += f" WHERE {where}" if where else ""
    else:
        sql += "DO NOTHING"
    conn.exec_driver_sql(sql, params)


def to_db(value: float | None) -> float | None:
    """A value as stored: NaN is SQL NULL (see models; "not measured" is never stored)."""
    return None if value is None or math.isnan(value) else value


def from_db(value: float | None) -> float:
    """A stored value back: NULL (a NaN point) is NaN."""
    return math.nan if value is None else value


def step_range(column: sa.ColumnElement[int], start: int | None, end: int | None) -> list[sa.ColumnElement[bool]]:
    """``start <= column <= end``, each bound left out when None."""
    out = []
    if start is not None:
        out.append(column >= start)
    if end is not None:
        out.append(column <= end)
    return out


def fetch_rows(conn: sa.Connection, stmt: sa.Select[Any]) -> list[tuple[Any, ...]]:
    """Every row of ``stmt`` as plain tuples, read through the driver's cursor on ``conn``'s transaction.

    For reads of thousands of rows (a run's frames): SQLAlchemy builds no row object per row, and
    PostgreSQL sends the rows in its binary format, so a ``bytea`` arrives as its bytes rather than
    as hex text that psycopg decodes (``bench/RESULTS.md``, whole-run history). Only for columns
    and parameters that need no SQLAlchemy type processing (integers, floats, bytes, booleans, text).
    """
    compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    cursor: Any = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]  # open: conn is in a transaction
    try:
        if is_postgres(conn):
            cursor.execute(str(compiled), compiled.params, binary=True)
        else:
            cursor.execute(str(compiled), [compiled.params[k] for k in compiled.positiontup or ()])
        return list(cursor.fetchall())
    finally:
        cursor.close()
