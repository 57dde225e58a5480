"""The sweep's per-step file keeps every value: a round trip through ``experiments.early_warning.instability_data``.

Synthetic runs with what a real one can hold: a NaN loss, a layer a report did not measure beside a
NaN one it did, two attempts, float32 metric values, scalars at their own steps. What comes back
must equal what went in, value for value (NaN for NaN, None for None).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments.early_warning.instability_data import RunRecord, load, save
from qkwatch.client.run_history import RunHistory
from qkwatch.rules.transitions import ReportValues


def _f32(x: float) -> float:
    return float(np.float32(x))


def _runs() -> list[RunRecord]:
    reports = [
        # as the collector gives them: a layer list runs to the highest layer measured, gaps as None
        ReportValues(1, 0, {"qkai": [_f32(0.3), _f32(0.31)], "attn_entropy": [_f32(0.9), math.nan]}),
        ReportValues(1, 10, {"qkai": [_f32(0.4), None, _f32(0.5)]}),
        ReportValues(2, 10, {"qkai": [_f32(0.45), _f32(0.46), _f32(0.47)], "logit_max": [_f32(1e3)]}),
    ]
    a = RunRecord(
        "lr-vanilla-1-s0",
        RunHistory("lr-vanilla-1-s0", reports, [0, 1, 2, 3], [5.5, 4.25, math.nan, math.inf]),
        [1, 3],
        [4.0, math.nan],
        {"grad_norm": ([0, 2], [1.5, 0.25]), "lr": ([0, 1, 2, 3], [1e-3, 1e-3, 9e-4, 8e-4])},
    )
    b = RunRecord("lr-qk_norm-0.001-s3", RunHistory("lr-qk_norm-0.001-s3", [], [0], [5.0]), [], [], {})
    return [a, b]


def test_every_value_comes_back_from_the_file(tmp_path: Path) -> None:
    runs = _runs()
    back = load(save(runs, tmp_path / "runs.npz"))
    assert list(back) == [r.name for r in runs]
    for r in runs:
        got = back[r.name]
        assert got.history.loss_steps == r.history.loss_steps
        assert [
            (x, y)
            for x, y in zip(got.history.losses, r.history.losses, strict=True)
            if not (x == y or (math.isnan(x) and math.isnan(y)))
        ] == []
        assert got.val_steps == r.val_steps
        assert np.array_equal(np.array(got.val_loss), np.array(r.val_loss), equal_nan=True)
        assert got.scalars == r.scalars
        want = sorted(r.history.reports, key=lambda x: (x.attempt, x.step))
        assert [(x.attempt, x.step) for x in got.history.reports] == [(x.attempt, x.step) for x in want]
        for g, w in zip(got.history.reports, want, strict=True):
            assert set(g.layers) == set(w.layers)
            for metric, values in w.layers.items():
                assert len(g.layers[metric]) == len(values)
                for x, y in zip(g.layers[metric], values, strict=True):
                    assert (x is None and y is None) or x == y or (math.isnan(x) and math.isnan(y)), (metric, x, y)


def test_the_file_names_its_runs_in_order_and_no_file_names_none(tmp_path: Path) -> None:
    from experiments.early_warning.instability_data import names

    runs = _runs()
    assert names(save(runs, tmp_path / "runs.npz")) == [r.name for r in runs]
    assert names(tmp_path / "absent.npz") == []
