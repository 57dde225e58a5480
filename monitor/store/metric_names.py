"""Metric names and their ids: points and frames store a small integer instead of the name."""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql


class MetricNames:
    """The id of each metric name, cached per process (a name's id never changes once given)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def missing(self, names: Iterable[str]) -> list[str]:
        """The names without a cached id, sorted."""
        return sorted(set(names) - self._ids.keys())

    def register(self, conn: sa.Connection, names: list[str]) -> None:
        """Give ``names`` ids (insert-or-ignore: another process may have given them already) and cache them."""
        t = m.metric_names
        conn.execute(sql.insert(conn, t).on_conflict_do_nothing(), [{"name": n} for n in names])
        rows = conn.execute(sa.select(t.c.id, t.c.name).where(t.c.name.in_(names))).all()
        self._ids.update({r.name: r.id for r in rows})

    def ids(self, names: Iterable[str]) -> dict[str, int]:
        """The cached ids of ``names`` (all registered before)."""
        return {n: self._ids[n] for n in names}

    def lookup(self, conn: sa.Connection, name: str) -> int | None:
        """The id of a metric name for a read; None when no run ever reported it."""
        if name not in self._ids:
            found = conn.execute(sa.select(m.metric_names.c.id).where(m.metric_names.c.name == name)).scalar()
            if found is None:
                return None
            self._ids[name] = found
        return self._ids[name]
