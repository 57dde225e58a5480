"""A run's whole history of some metrics, unbucketed: per metric, a steps x layers grid.

Layer values come from the frames (one row per report and metric, as the heatmap reads them),
scalars from the points, as layer -1. Per (step, layer) the latest attempt that logged it wins,
unless one attempt is asked for.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from itertools import pairwise
from typing import TypeGuard

import sqlalchemy as sa

from qkwatch.monitor.store import metric_names, sql
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.errors import Invalid
from qkwatch.monitor.store.values import frames, reads

Doubles = tuple[list[int], list[int], bytes, bytes | None]
"""(steps, layers, float64 values step-major with NaN where not measured, measured bytes or None)."""
FrameRead = tuple[int, int, bytes, bytes | None, bool]
"""A frame row as :func:`_rows` reads it: (metric id, step, vals, present, has_nan; 0 or 1 on SQLite)."""
Scalar = tuple[int, float]
"""A run-level scalar point: (step, value)."""


def grids(
    conn: sa.Connection,
    run: m.RunRow,
    metrics: Sequence[str],
    start: int | None,
    end: int | None,
    attempt: int | None,
    max_points: int | None,
) -> dict[str, m.Heatmap]:
    """Per metric with values in the range, its grid; a cell is None where nothing was measured.

    Raises:
        Invalid: the answer would hold more than ``max_points`` values.
    """
    rows = _rows(conn, run, metrics, start, end, attempt, max_points)
    return {name: _grid(frames.merge_steps(r[1:] for r in fr), sc) for name, (fr, sc) in rows.items()}


def doubles(
    conn: sa.Connection,
    run: m.RunRow,
    metrics: Sequence[str],
    start: int | None,
    end: int | None,
    attempt: int | None,
    max_points: int | None,
) -> dict[str, Doubles]:
    """:func:`grids` as float64 bytes: per metric (steps, layers, values, measured).

    ``values`` holds the steps x layers doubles, step-major, in native byte order, NaN where
    nothing was measured; ``measured`` one byte per value (1: measured), or None when all were.
    A metric stored as one full frame per step (one attempt, every layer reported at once: the
    usual run) is its frames' bytes as stored, with no value handled one by one.
    """
    out: dict[str, Doubles] = {}
    for name, (fr, sc) in _rows(conn, run, metrics, start, end, attempt, max_points).items():
        if not sc and _one_full_frame_per_step(fr):
            out[name] = ([r[1] for r in fr], list(range(len(fr[0][2]) // 8)), b"".join(r[2] for r in fr), None)
        else:
            out[name] = _doubles(_grid(frames.merge_steps(r[1:] for r in fr), sc))
    return out


def _rows(
    conn: sa.Connection,
    run: m.RunRow,
    metrics: Sequence[str],
    start: int | None,
    end: int | None,
    attempt: int | None,
    max_points: int | None,
) -> dict[str, tuple[list[FrameRead], list[Scalar]]]:
    """Per metric with values: its frame rows (metric id, step, vals, present, has_nan) in (step, attempt)
    order, and its scalar points (step, value) in the merged view (or of ``attempt``)."""
    f, p = m.frames, m.points
    named = metric_names.lookup_many(conn, metrics)
    ids = {named[name]: name for name in metrics if name in named}
    if not ids:
        return {}
    fw = [f.c.run_pk == run.pk, f.c.metric_id.in_(list(ids)), *sql.step_range(f.c.step, start, end)]
    fw += [f.c.attempt == attempt] if attempt is not None else []
    pw = [
        p.c.run_pk == run.pk,
        p.c.metric_id.in_(list(ids)),
        *m.RUN_SCALARS,
        *sql.step_range(p.c.step, start, end),
        *reads.attempt_filter(run, attempt),
    ]
    if max_points is not None:
        _check_size(conn, fw, pw, max_points)
    frame_rows = sql.fetch_rows(
        conn,
        sa.select(f.c.metric_id, f.c.step, f.c.vals, f.c.present, f.c.has_nan)
        .where(*fw)
        .order_by(f.c.metric_id, f.c.step, f.c.attempt, f.c.mask),
    )
    scalar_rows = conn.execute(
        sa.select(p.c.metric_id, p.c.step, p.c.value).where(*pw).order_by(p.c.metric_id, p.c.step)
    ).all()
    by_metric: dict[int, tuple[list[FrameRead], list[Scalar]]] = {i: ([], []) for i in ids}
    for row in frame_rows:
        by_metric[row[0]][0].append(row)
    for point in scalar_rows:
        by_metric[point.metric_id][1].append((point.step, sql.from_db(point.value)))
    return {ids[i]: (fr, sc) for i, (fr, sc) in by_metric.items() if fr or sc}


def _check_size(
    conn: sa.Connection,
    frame_where: list[sa.ColumnElement[bool]],
    scalar_where: list[sa.ColumnElement[bool]],
    limit: int,
) -> None:
    """Raise :class:`Invalid` naming both counts and the limit when the layer values (8 bytes each in
    the frames) and the scalar points together are more than ``limit``; counted before any is read."""
    f, p = m.frames, m.points
    frame_bytes = sa.select(sa.func.coalesce(sa.func.sum(sa.func.length(f.c.vals)), 0)).where(*frame_where)
    scalar_count = sa.select(sa.func.count()).select_from(p).where(*scalar_where)
    counts = conn.execute(sa.select(frame_bytes.scalar_subquery(), scalar_count.scalar_subquery())).one()
    layer_values, scalars = int(counts[0]) // 8, int(counts[1])
    if layer_values + scalars > limit:
        raise Invalid(
            f"the history holds {layer_values + scalars} values ({layer_values} layer values and {scalars} "
            f"scalar values), more than {limit}, the most one answer may hold: "
            "ask for fewer metrics or a step range (start, end)"
        )


def _grid(steps: list[frames.MergedStep], scalars: list[Scalar]) -> m.Heatmap:
    """Merged frames (``frames.merge_steps``) and scalar points -> a steps x layers grid (layer -1: the scalar)."""
    n = max((len(s.values) for s in steps), default=0)
    seen = [False] * n
    for s in steps:
        if s.clean:
            seen[: len(s.values)] = [True] * len(s.values)
        else:
            for i, v in enumerate(s.values):
                seen[i] = seen[i] or v is not None
    layers = [i for i in range(n) if seen[i]]
    rows = {s.step: s.values if len(s.values) == n else [*s.values, *[None] * (n - len(s.values))] for s in steps}
    if len(layers) < n:
        rows = {step: [row[i] for i in layers] for step, row in rows.items()}
    if not scalars:
        return m.Heatmap(list(rows), layers, list(rows.values()), False)
    by_step = dict(scalars)
    order = sorted(rows.keys() | by_step.keys())
    empty = [None] * len(layers)
    return m.Heatmap(order, [m.RUN_SCALAR, *layers], [[by_step.get(s), *rows.get(s, empty)] for s in order], False)


def _one_full_frame_per_step(rows: list[FrameRead]) -> bool:
    """Frame rows (metric id, step, vals, present, has_nan) that are the grid as they are: one per step,
    every layer."""
    return (
        bool(rows)
        and all(r[3] is None for r in rows)
        and len({len(r[2]) for r in rows}) == 1
        and all(a[1] < b[1] for a, b in pairwise(rows))
    )


def _doubles(grid: m.Heatmap) -> Doubles:
    """A grid -> (steps, layers, float64 bytes step-major with NaN where not measured, measured bytes or None)."""
    vals, measured, holes = array("d"), bytearray(), False
    for row in grid.values:
        if _complete(row):
            vals.extend(row)
            measured += b"\x01" * len(row)
        else:
            holes = True
            vals.extend(math.nan if v is None else v for v in row)
            measured += bytes(v is not None for v in row)
    return grid.steps, grid.layers, vals.tobytes(), bytes(measured) if holes else None


def _complete(row: Sequence[float | None]) -> TypeGuard[Sequence[float]]:
    """Every layer measured (one C-level scan for None)."""
    return None not in row
