"""A layer's series is read from the frames (migration 0011 put the step before the layer in the points'
key). It must be the series the points hold: checked here against the points themselves (the
export's merged view, or one attempt's; buckets by the SQL aggregates the points' read used), on
both databases, with attempts that overwrite each other, layers reported by some reports only, NaN,
infinities, values near the float64 maximum and buckets."""

from __future__ import annotations

import math
import uuid
from itertools import count

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import metric_names
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.store.values import means, reads
from qkwatch.rules.ruleset import RuleSet

LAYERS = 4
RULES = RuleSet.default(0.7)
NAMES = count()

# A layer's value on the wire: a number, "nan" or an infinity, or None (not measured by this report).
wire_value = st.one_of(
    st.none(),
    st.floats(-1e6, 1e6, allow_nan=False),
    st.sampled_from(
        ["nan", "inf", "-inf", 1.7e308]
    ),  # no -1.7e308: how it cancels 1.7e308 depends on the order of the sum
)
report = st.tuples(st.integers(0, 12), st.lists(wire_value, min_size=1, max_size=LAYERS))
attempt_reports = st.lists(report, min_size=1, max_size=12)


def _expected(
    conn: sa.Connection,
    run: m.RunRow,
    layer: int,
    attempt: int | None,
    points: list[tuple[int, float]],
    max_points: int,
) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, means, mins, maxs) of a layer's points (step, value), as the read of the points did before
    0011: the values themselves, or per bucket the SQL aggregates of ``means``."""
    if len(points) <= max_points:
        vals = [v for _, v in points]
        return [s for s, _ in points], vals, vals, vals
    lo, hi = points[0][0], points[-1][0]
    width = -(-(hi - lo + 1) // max_points)
    p = m.points
    bucket = ((p.c.step - lo) // width).label("b")
    where = [
        p.c.run_pk == run.pk,
        p.c.metric_id == metric_names.lookup(conn, "qkai"),
        p.c.head == m.LAYER_VALUE,
        p.c.layer == layer,
        *reads.attempt_filter(run, attempt),
    ]
    rows = conn.execute(
        sa.select(bucket, sa.func.min(p.c.step), *means.aggregates(p.c.value))
        .where(*where)
        .group_by(bucket)
        .order_by(bucket)
    ).all()
    nan_if_empty = [(r[4], r[5], r[6]) for r in rows]
    return (
        [r[1] for r in rows],
        [means.of_aggregates(*r[2:]) for r in rows],
        [math.nan if not n or lo_ is None else lo_ for lo_, _, n in nan_if_empty],
        [math.nan if not n or hi_ is None else hi_ for _, hi_, n in nan_if_empty],
    )


def _same(got: list[float | None], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        g is not None and ((math.isnan(w) and math.isnan(g)) or math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-9))
        for g, w in zip(got, want, strict=True)
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attempts=st.lists(attempt_reports, min_size=1, max_size=2), max_points=st.integers(1, 8), data=st.data())
def test_layer_series_from_frames_equals_the_points(db_url, attempts, max_points, data):
    engine = make_engine(db_url)
    store = Store(engine)
    try:
        name = f"series-{next(NAMES)}-{uuid.uuid4().hex[:6]}"
        for i, reports in enumerate(attempts):
            run, _ = store.create_or_resume_run(RunCreate(project="series", name=name, attempt_key=f"a{i}"))
            for step, values in reports:  # one report a batch: a step may come twice, the first value stays
                body = {"step": step, "time": 1.0, "layers": {"qkai": values}}
                store.add_reports(
                    run.id, ReportBatch.model_validate({"batch_id": uuid.uuid4(), "reports": [body]}), RULES
                )
        run = store.get_run(run.id)
        layer = data.draw(st.integers(0, LAYERS - 1))
        attempt = data.draw(st.sampled_from([None, *range(1, len(attempts) + 1)]))
        points = sorted(
            (step, value)
            for (att, step, metric, la, head, value) in store.export_rows(run, attempt=attempt)
            if metric == "qkai" and la == layer and head == -1
        )
        got = store.series(run, "qkai", layer, max_points=max_points, attempt=attempt)
        with engine.connect() as conn:
            steps, mean, mins, maxs = _expected(conn, run, layer, attempt, points, max_points)
        assert got.steps == steps
        assert got.downsampled == (len(points) > max_points)
        assert _same(list(got.values), mean)
        assert _same(list(got.mins), mins) and _same(list(got.maxs), maxs)
    finally:
        store.close()
