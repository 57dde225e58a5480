"""Flattening report batches into rows, and the bulk insert paths of each database.

The cost of a batch is constant in the run's history: points go in with insert-or-ignore on
their natural key (an index probe each), never a read of what is already stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sqlalchemy as sa

from monitor.store.engine import is_postgres
from monitor.store.models import LAYER_VALUE, RUN_SCALAR
from monitor.wire import ReportBatch, decode_value

PointRow = tuple[str, int, int, int, float | None]
"""(metric, head, layer, step, value); a NaN value is None (see models)."""


@dataclass
class FlatBatch:
    """A validated batch as rows, ready to insert."""

    points: list[PointRow] = field(default_factory=list)
    latest: dict[tuple[str, int], tuple[int, float | None]] = field(default_factory=dict)
    """(metric, layer) -> (step, value) of the newest layer-level value or scalar in the batch."""
    layer_values: list[tuple[int, dict[str, list[float | None]]]] = field(default_factory=list)
    """(step, metric -> decoded value per layer) per report, for the schedule and the alert rules."""
    events: list[tuple[int, str, str, dict, float]] = field(default_factory=list)
    max_step: int = -1


def _stored(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def flatten(batch: ReportBatch) -> FlatBatch:
    """Decode every value and lay the batch out as point rows (nulls, "not measured", are dropped)."""
    flat = FlatBatch()
    pts = flat.points
    for report in batch.reports:
        step = report.step
        flat.max_step = max(flat.max_step, step)
        decoded: dict[str, list[float | None]] = {}
        for metric, values in report.layers.items():
            row = [decode_value(v) for v in values]
            decoded[metric] = row
            for layer, value in enumerate(row):
                if value is not None:
                    pts.append((metric, LAYER_VALUE, layer, step, _stored(value)))
                    _keep_latest(flat.latest, metric, layer, step, value)
        for metric, per_layer in report.heads.items():
            for layer, heads in enumerate(per_layer):
                for head, raw in enumerate(heads or ()):
                    value = decode_value(raw)
                    if value is not None:
                        pts.append((metric, head, layer, step, _stored(value)))
        for name, raw in report.scalars.items():
            value = decode_value(raw)
            if value is not None:
                pts.append((name, RUN_SCALAR, RUN_SCALAR, step, _stored(value)))
                _keep_latest(flat.latest, name, RUN_SCALAR, step, value)
        flat.layer_values.append((step, decoded))
        flat.events += [(step, e.kind, e.message, e.data, report.time) for e in report.events]
    return flat


def _keep_latest(latest: dict, metric: str, layer: int, step: int, value: float) -> None:
    key = (metric, layer)
    if key not in latest or latest[key][0] <= step:
        latest[key] = (step, _stored(value))


def insert_points(conn: sa.Connection, run_pk: int, attempt: int, rows: list[PointRow]) -> int:
    """Insert-or-ignore ``rows``; returns how many were new."""
    if not rows:
        return 0
    if is_postgres(conn):
        return _insert_points_postgres(conn, run_pk, attempt, rows)
    return _insert_points_sqlite(conn, run_pk, attempt, rows)


def _insert_points_sqlite(conn: sa.Connection, run_pk: int, attempt: int, rows: list[PointRow]) -> int:
    # One prepared statement run over all rows (sqlite3's executemany, in C); its rowcount sums
    # the rows actually inserted, so ignored duplicates are not counted.
    params = [(run_pk, m, h, la, s, attempt, v) for (m, h, la, s, v) in rows]
    result = conn.exec_driver_sql(
        "INSERT INTO points (run_pk, metric, head, layer, step, attempt, value) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", params)
    return result.rowcount


def _insert_points_postgres(conn: sa.Connection, run_pk: int, attempt: int, rows: list[PointRow]) -> int:
    # One statement for the whole batch: columns travel as arrays and unnest() turns them back
    # into rows; the rowcount of INSERT ... ON CONFLICT DO NOTHING is exactly the new rows.
    metric, head, layer, step, value = (list(col) for col in zip(*rows, strict=True))
    result = conn.exec_driver_sql(
        "INSERT INTO points (run_pk, metric, head, layer, step, attempt, value) "
        "SELECT %(run_pk)s, m, h, l, s, %(attempt)s, v FROM unnest("
        "%(metric)s::varchar[], %(head)s::int[], %(layer)s::int[], %(step)s::bigint[], %(value)s::float8[]"
        ") AS t(m, h, l, s, v) ON CONFLICT DO NOTHING",
        {"run_pk": run_pk, "attempt": attempt, "metric": metric, "head": head, "layer": layer,
         "step": step, "value": value})
    return result.rowcount
