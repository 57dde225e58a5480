"""A run's event log (checkpoints, restarts, clipped overrides...): written on ingest, read by the API."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from qkwatch.contract.values import clip_depth
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql

EventIn = tuple[int, str, str, dict[str, Any], float]
"""(step, kind, message, data, time) of an event to store."""


@dataclass(frozen=True)
class EventRow:
    attempt: int
    step: int
    kind: str
    message: str
    data: dict[str, Any]
    time: float


def insert(conn: sa.Connection, run_pk: int, attempt: int, events: list[EventIn]) -> None:
    """Insert-or-ignore: a replayed event (same attempt, step and kind) is stored once."""
    if events:
        conn.execute(
            sql.insert(conn, m.events).on_conflict_do_nothing(),
            [
                {
                    "run_pk": run_pk,
                    "attempt": attempt,
                    "step": s,
                    "kind": k,
                    "message": msg,
                    "data": json.dumps(d),
                    "time": t,
                }
                for (s, k, msg, d, t) in events
            ],
        )


def select(conn: sa.Connection, run: m.RunRow, kind: str | None, attempt: int | None, limit: int) -> list[EventRow]:
    """The run's events (of ``kind``, of ``attempt``), by step."""
    e = m.events
    q = sa.select(e).where(e.c.run_pk == run.pk)
    if kind:
        q = q.where(e.c.kind == kind)
    if attempt is not None:
        q = q.where(e.c.attempt == attempt)
    rows = conn.execute(q.order_by(e.c.step, e.c.attempt, e.c.kind).limit(limit)).all()
    return [EventRow(r.attempt, r.step, r.kind, r.message, clip_depth(json.loads(r.data)), r.time) for r in rows]
