"""``ingest.flatten`` lays a batch out the same whichever path a row takes: finite-float rows go
through C-level ``zip``/``array`` and whole-row latest values, other rows a value at a time. The
reference below is ``flatten`` as it was before that fast path, one value at a time throughout."""

from __future__ import annotations

import math
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from qkwatch.contract.values import decode_value
from qkwatch.contract.wire import ReportBatch
from qkwatch.monitor.store import sql
from qkwatch.monitor.store.models import LAYER_VALUE, RUN_SCALAR
from qkwatch.monitor.store.values import frames, ingest


def reference_flatten(batch: ReportBatch) -> ingest.FlatBatch:
    flat = ingest.FlatBatch()
    pts = flat.points

    def keep_latest(metric: str, layer: int, step: int, value: float) -> None:
        key = (metric, layer)
        if key not in flat.latest or flat.latest[key][0] <= step:
            flat.latest[key] = (step, sql.to_db(value))

    for report in batch.reports:
        step = report.step
        flat.max_step = max(flat.max_step, step)
        decoded: dict[str, list[float | None]] = {}
        for metric, values in report.layers.items():
            row = [decode_value(v) for v in values]
            decoded[metric] = row
            frame = frames.pack(metric, step, row)
            if frame is not None:
                flat.frames.append(frame)
            for layer, value in enumerate(row):
                if value is not None:
                    pts.append((metric, LAYER_VALUE, layer, step, sql.to_db(value)))
                    keep_latest(metric, layer, step, value)
        for metric, per_layer in report.heads.items():
            for layer, heads in enumerate(per_layer):
                for head, raw in enumerate(heads or ()):
                    value = decode_value(raw)
                    if value is not None:
                        pts.append((metric, head, layer, step, sql.to_db(value)))
        for name, raw in report.scalars.items():
            value = decode_value(raw)
            if value is not None:
                pts.append((name, RUN_SCALAR, RUN_SCALAR, step, sql.to_db(value)))
                keep_latest(name, RUN_SCALAR, step, value)
        flat.layer_values.append((step, decoded))
        flat.events += [(step, e.kind, e.message, e.data, report.time) for e in report.events]
    return flat


def same(a: ingest.FlatBatch, b: ingest.FlatBatch) -> None:
    # repr: a NaN equals itself there, and -0.0 differs from 0.0; types count (an int is not a float)
    assert repr(a.points) == repr(b.points)
    assert repr(a.frames) == repr(b.frames)
    assert repr(sorted(a.latest.items())) == repr(sorted(b.latest.items()))
    assert repr(a.layer_values) == repr(b.layer_values)
    assert a.events == b.events and a.max_step == b.max_step


values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_nan=False, allow_infinity=False),  # twice as likely: rows of finite floats are the usual ones
    st.sampled_from([None, "nan", "inf", "-inf", math.nan, math.inf, -math.inf, -0.0, 0, 7, -3]),
)
finite_row = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=6)
row = st.one_of(finite_row, finite_row, st.lists(values, max_size=6))
names = st.sampled_from(["qkai", "attn_entropy", "loss", "m.x"])
reports = st.lists(
    st.fixed_dictionaries(
        {
            "step": st.integers(0, 6),  # steps repeat and go back within a batch
            "time": st.just(1.0),
            "layers": st.dictionaries(names, row, max_size=3),
            "heads": st.dictionaries(
                names, st.lists(st.one_of(st.none(), st.lists(values, max_size=3)), max_size=2), max_size=1
            ),
            "scalars": st.dictionaries(names, values, max_size=2),
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(reports)
def test_flatten_equals_the_value_at_a_time_reference(reports: list[dict]) -> None:
    batch = ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports})
    same(ingest.flatten(batch), reference_flatten(batch))


def test_a_finite_row_and_a_row_with_gaps_of_one_batch() -> None:
    batch = ReportBatch.model_validate(
        {
            "batch_id": str(uuid.uuid4()),
            "reports": [
                {"step": 3, "time": 1.0, "layers": {"qkai": [0.5, 0.25], "pr_gap": [None, "nan", 2]}},
                {"step": 2, "time": 1.0, "layers": {"qkai": [0.1, 0.2, 0.3]}, "scalars": {"loss": "inf"}},
                {"step": 3, "time": 1.0, "layers": {"qkai": [0.75]}, "scalars": {"loss": 1.5}},
            ],
        }
    )
    flat = ingest.flatten(batch)
    same(flat, reference_flatten(batch))
    # the newest per layer: step 3's later report for layer 0, its earlier one for layer 1, step 2 for layer 2
    assert flat.latest[("qkai", 0)] == (3, 0.75) and flat.latest[("qkai", 1)] == (3, 0.25)
    assert flat.latest[("qkai", 2)] == (2, 0.3)
    assert flat.latest[("pr_gap", 1)] == (3, None) and flat.latest[("pr_gap", 2)] == (3, 2.0)
    assert flat.latest[("loss", RUN_SCALAR)] == (3, 1.5)
    assert ("qkai", 3, "a2", frames.pack("qkai", 3, [0.5, 0.25])[3], None, False) in flat.frames
