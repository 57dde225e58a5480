"""Reads of a run's values: series, heatmaps, latest values, export.

Every read of points shows one value per (step, metric, layer, head): the latest attempt that
logged it wins (:func:`attempt_filter`), unless the caller asks for one attempt.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import sqlalchemy as sa

from qkwatch.monitor.store import metric_names, sql
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.runs import lookup
from qkwatch.monitor.store.values import frames, means


def attempt_filter(run: m.RunRow, attempt: int | None) -> list[sa.ColumnElement[bool]]:
    """Conditions on ``points`` that keep the points of ``attempt``, or with None the merged view.

    The merged view: per (step, metric, layer, head) the latest attempt that logged it wins. A run
    with one attempt needs no condition.
    """
    p = m.points
    if attempt is not None:
        return [p.c.attempt == attempt]
    if run.latest_attempt <= 1:
        return []
    q = m.points.alias("newer")
    return [
        ~sa.exists().where(
            q.c.run_pk == p.c.run_pk,
            q.c.metric_id == p.c.metric_id,
            q.c.head == p.c.head,
            q.c.layer == p.c.layer,
            q.c.step == p.c.step,
            q.c.attempt > p.c.attempt,
        )
    ]


def _point_filter(run: m.RunRow, metric_id: int | None, head: int, attempt: int | None) -> list[sa.ColumnElement[bool]]:
    p = m.points
    return [
        p.c.run_pk == run.pk,
        p.c.metric_id == (-1 if metric_id is None else metric_id),
        p.c.head == head,
        *attempt_filter(run, attempt),
    ]


def has_points(conn: sa.Connection, run: m.RunRow, metric: str, head: int) -> bool:
    """Whether the run stored any point of ``metric`` for ``head`` (-1: layer values and scalars)."""
    p = m.points
    metric_id = metric_names.lookup(conn, metric)
    if metric_id is None:
        return False
    q = sa.select(sa.literal(1)).where(p.c.run_pk == run.pk, p.c.metric_id == metric_id, p.c.head == head)
    return conn.execute(q.limit(1)).first() is not None


def series(
    conn: sa.Connection,
    run: m.RunRow,
    metric: str,
    layer: int,
    head: int,
    start: int | None,
    end: int | None,
    max_points: int,
    attempt: int | None,
) -> m.Series:
    """One layer's (or a scalar's) values; more than ``max_points`` steps are bucketed keeping min and max.

    A layer value is read from the frames (the points' key puts the step before the layer, so one
    layer over many steps is not a range of it); a per-head value or a scalar from the points.
    """
    if head == m.LAYER_VALUE and layer >= 0:
        return _series_from_frames(conn, run, metric, layer, start, end, max_points, attempt)
    p = m.points
    where = [
        *_point_filter(run, metric_names.lookup(conn, metric), head, attempt),
        *(m.RUN_SCALARS if (head, layer) == (m.LAYER_VALUE, m.RUN_SCALAR) else [p.c.layer == layer]),
        *sql.step_range(p.c.step, start, end),
    ]
    n, lo, hi = conn.execute(
        sa.select(sa.func.count(), sa.func.min(p.c.step), sa.func.max(p.c.step)).where(*where)
    ).one()
    if not n:
        return m.Series([], [], [], [], False)
    if n <= max_points:
        rows = conn.execute(sa.select(p.c.step, p.c.value).where(*where).order_by(p.c.step)).all()
        vals = [sql.from_db(r.value) for r in rows]
        return m.Series([r.step for r in rows], vals, vals, vals, False)
    width = -(-(hi - lo + 1) // max_points)
    bucket = ((p.c.step - lo) // width).label("b")
    buckets = conn.execute(
        sa.select(bucket, sa.func.min(p.c.step), *means.aggregates(p.c.value))
        .where(*where)
        .group_by(bucket)
        .order_by(bucket)
    ).all()
    # a row: bucket, first step, then means.aggregates: big, small, min, max, non-null count
    return m.Series(
        [r[1] for r in buckets],
        [means.of_aggregates(*r[2:]) for r in buckets],
        [_agg(r[4], r[6]) for r in buckets],
        [_agg(r[5], r[6]) for r in buckets],
        True,
    )


def _frame_filter(
    conn: sa.Connection, run: m.RunRow, metric: str, start: int | None, end: int | None, attempt: int | None
) -> list[sa.ColumnElement[bool]]:
    """Conditions on ``frames``: the run's frames of ``metric`` in the step range, of ``attempt`` or all."""
    f = m.frames
    metric_id = metric_names.lookup(conn, metric)
    where = [
        f.c.run_pk == run.pk,
        f.c.metric_id == (-1 if metric_id is None else metric_id),
        *sql.step_range(f.c.step, start, end),
    ]
    return where + ([f.c.attempt == attempt] if attempt is not None else [])


def _series_from_frames(
    conn: sa.Connection,
    run: m.RunRow,
    metric: str,
    layer: int,
    start: int | None,
    end: int | None,
    max_points: int,
    attempt: int | None,
) -> m.Series:
    """:func:`series` of a layer value, from the 8 bytes of ``layer`` in each frame (cut out in SQL).

    The same answer as the points would give: per step the latest attempt that logged the layer wins
    (``frames.merge_steps``'s rule), and buckets as in SQL (``means.of_values`` of the non-NaN values,
    NaN when a bucket holds only NaN).
    """
    f = m.frames
    where = _frame_filter(conn, run, metric, start, end, attempt)
    rows = conn.execute(
        sa.select(f.c.step, sa.func.substr(f.c.vals, 8 * layer + 1, 8), sa.func.substr(f.c.present, layer + 1, 1))
        .where(*where)
        .order_by(f.c.step, f.c.attempt, f.c.mask)
    ).all()
    steps, vals = frames.column(rows)
    if len(steps) <= max_points:
        return m.Series(steps, vals, vals, vals, False)
    lo, hi = steps[0], steps[-1]
    width = -(-(hi - lo + 1) // max_points)
    firsts: list[int] = []
    groups: list[list[float]] = []
    last = None
    for step, value in zip(steps, vals, strict=True):
        b = (step - lo) // width
        if b != last:
            firsts.append(step)
            groups.append([])
            last = b
        groups[-1].append(value)
    real = [[v for v in g if not math.isnan(v)] for g in groups]
    return m.Series(
        firsts,
        [means.of_values(r) if r else math.nan for r in real],
        [min(r) if r else math.nan for r in real],
        [max(r) if r else math.nan for r in real],
        True,
    )


def heatmap(
    conn: sa.Connection,
    run: m.RunRow,
    metric: str,
    start: int | None,
    end: int | None,
    max_steps: int,
    agg: str,
    head: int,
    attempt: int | None,
) -> m.Heatmap:
    """All layers of one metric over steps; steps bucketed to at most ``max_steps`` by ``agg``.

    Layer values are read from the frames, per-head values from the points.
    """
    if head == m.LAYER_VALUE:
        return _heatmap_from_frames(conn, run, metric, start, end, max_steps, agg, attempt)
    p = m.points
    where = [
        *_point_filter(run, metric_names.lookup(conn, metric), head, attempt),
        p.c.layer >= 0,
        *sql.step_range(p.c.step, start, end),
    ]
    lo, hi = conn.execute(sa.select(sa.func.min(p.c.step), sa.func.max(p.c.step)).where(*where)).one()
    if lo is None:
        return m.Heatmap([], [], [], False)
    width = max(1, -(-(hi - lo + 1) // max_steps))
    bucket = ((p.c.step - lo) // width).label("b") if width > 1 else p.c.step.label("b")
    if agg == "mean":
        rows = [
            (b, layer, step, means.of_aggregates(*aggs), aggs[-1])
            for b, layer, step, *aggs in conn.execute(
                sa.select(bucket, p.c.layer, sa.func.min(p.c.step), *means.aggregates(p.c.value))
                .where(*where)
                .group_by(bucket, p.c.layer)
            )
        ]
    else:
        fn = sa.func.max if agg == "max" else sa.func.min
        rows = [
            tuple(r)
            for r in conn.execute(
                sa.select(bucket, p.c.layer, sa.func.min(p.c.step), fn(p.c.value), sa.func.count(p.c.value))
                .where(*where)
                .group_by(bucket, p.c.layer)
            )
        ]
    return _pivot(rows, width > 1)


def _heatmap_from_frames(
    conn: sa.Connection,
    run: m.RunRow,
    metric: str,
    start: int | None,
    end: int | None,
    max_steps: int,
    agg: str,
    attempt: int | None,
) -> m.Heatmap:
    f = m.frames
    where = _frame_filter(conn, run, metric, start, end, attempt)
    rows = conn.execute(
        sa.select(f.c.step, f.c.vals, f.c.present, f.c.has_nan).where(*where).order_by(f.c.step, f.c.attempt, f.c.mask)
    ).all()
    steps, layers, values, downsampled = frames.heatmap(frames.merge_steps(rows), max_steps, agg)
    return m.Heatmap(steps, layers, values, downsampled)


def _agg(value: float | None, non_null: int) -> float:
    """An aggregate over a bucket: NULL with no non-NaN member means every member was NaN."""
    return math.nan if value is None or not non_null else float(value)


def _pivot(rows: Sequence[tuple[int, int, int, float | None, int]], downsampled: bool) -> m.Heatmap:
    """Rows (bucket, layer, first step, aggregate, non-null count) -> a heatmap of buckets by layers."""
    buckets = sorted({r[0] for r in rows})
    layers = sorted({r[1] for r in rows})
    bi = {b: i for i, b in enumerate(buckets)}
    li = {la: i for i, la in enumerate(layers)}
    steps: list[int] = [0] * len(buckets)
    first = [True] * len(buckets)
    values: list[list[float | None]] = [[None] * len(layers) for _ in buckets]
    for b, layer, step, value, non_null in rows:
        i = bi[b]
        if first[i] or step < steps[i]:
            steps[i], first[i] = step, False
        values[i][li[layer]] = _agg(value, non_null)
    return m.Heatmap(steps, layers, values, downsampled)


def export_rows(conn: sa.Connection, run: m.RunRow, attempt: int | None, chunk: int) -> Iterator[m.ExportRow]:
    """Every point of the run (merged view unless ``attempt``) as (attempt, step, metric, layer, head, value),
    streamed ``chunk`` rows at a time."""
    p, names = m.points, m.metric_names
    stmt = (
        sa.select(p.c.attempt, p.c.step, names.c.name.label("metric"), p.c.layer, p.c.head, p.c.value)
        .join(names, names.c.id == p.c.metric_id)
        .where(p.c.run_pk == run.pk, *attempt_filter(run, attempt))
        .order_by(p.c.metric_id, p.c.head, p.c.layer, p.c.step, p.c.attempt)
    )
    for r in conn.execution_options(yield_per=chunk).execute(stmt):
        yield (r.attempt, r.step, r.metric, r.layer, r.head, sql.from_db(r.value))


def run_metrics(conn: sa.Connection, run: m.RunRow) -> dict[str, list[int]]:
    """Metric name -> layers that reported it (``[-1]`` for a run-level scalar)."""
    rows = conn.execute(
        sa.select(m.latest.c.metric, m.latest.c.layer)
        .where(m.latest.c.run_pk == run.pk)
        .order_by(m.latest.c.metric, m.latest.c.layer)
    ).all()
    out: dict[str, list[int]] = {}
    for r in rows:
        out.setdefault(r.metric, []).append(r.layer)
    return out


def latest_snapshot(
    conn: sa.Connection,
    metrics: Sequence[str],
    max_runs: int,
    max_layers: int,
    projects: Sequence[str] | None,
    prefixes: Sequence[str] = (),
) -> tuple[list[m.RunRow], list[m.LatestRow]]:
    """Running runs (most recently updated first, at most ``max_runs``; of ``projects``, None = all)
    and their latest values of ``metrics``, and of every metric that starts with one of ``prefixes``."""
    where = [m.runs.c.status == "running"]
    if projects is not None:
        where.append(m.runs.c.project.in_(list(projects)))
    found = lookup.run_rows(
        conn, conn.execute(sa.select(m.runs).where(*where).order_by(m.runs.c.updated_at.desc()).limit(max_runs)).all()
    )
    if not found:
        return [], []
    by_pk = {r.pk: r for r in found}
    named = sa.or_(
        m.latest.c.metric.in_(list(metrics)), *(m.latest.c.metric.startswith(p, autoescape=True) for p in prefixes)
    )
    rows = conn.execute(
        sa.select(m.latest).where(m.latest.c.run_pk.in_(list(by_pk)), named, m.latest.c.layer < max_layers)
    ).all()
    return found, [
        m.LatestRow(
            by_pk[r.run_pk].id,
            by_pk[r.run_pk].name,
            by_pk[r.run_pk].project,
            r.metric,
            r.layer,
            r.step,
            sql.from_db(r.value),
        )
        for r in rows
    ]
