"""What the store sends and how the database plans it: the statements a call sends (caught at the
cursor), and the database's own plan of one (PostgreSQL ``EXPLAIN``, SQLite ``EXPLAIN QUERY PLAN``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa

T = TypeVar("T")


def statements(
    engine: sa.Engine, wanted: Callable[[str], bool], action: Callable[[], T]
) -> tuple[T, list[tuple[str, object]]]:
    """What ``action()`` returns, and the statements (with their parameters) it sends through ``engine``
    for which ``wanted`` holds."""
    seen: list[tuple[str, object]] = []

    def note(conn, cursor, statement, parameters, context, executemany) -> None:
        if wanted(statement):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        result = action()
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)
    return result, seen


def plan_of(engine: sa.Engine, statement: str, parameters: object, *, analyze: bool = False) -> str:
    """The database's plan of ``statement``, one line per row; ``analyze``: PostgreSQL runs it (EXPLAIN ANALYZE)."""
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        if engine.dialect.name == "postgresql":
            cursor.execute(("EXPLAIN ANALYZE " if analyze else "EXPLAIN ") + statement, parameters)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + statement, parameters)
        return "\n".join(" ".join(map(str, row)) for row in cursor.fetchall())
