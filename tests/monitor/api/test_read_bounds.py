"""Issue 21, M5 and L1: reads of a run stay bounded and finite.

M5: the history bound (``MAX_HISTORY_VALUES``, 2,000,000) counted only layer values, so 100 scalars
x 22,500 steps came back whole (2.25 M values, 26 MB, 42 s). It counts scalars now, before it
reads any value. The bound is lowered here so that the run stays small.

L1: a bucket of huge finite values (1.7e308) averaged to ``inf`` on SQLite and raised "value out
of range" on PostgreSQL (a 422 on a GET). Every downsampled mean is finite now, the same on both.
"""

from __future__ import annotations

import math
import sys

import pytest

from qkwatch.monitor.api import queries
from tests.monitor.conftest import report

HUGE = 1.7e308
MAX = sys.float_info.max


def detail(h, path: str, status: int, **params) -> str:
    r = h.client.get(path, params=params, headers=h.headers("read"))
    assert r.status_code == status, r.text[:300]
    return r.json()["detail"]


# --- M5: the history bound counts scalars --------------------------------------------------------


def test_history_of_scalars_past_the_bound_is_422_naming_the_limit_and_the_count(h, monkeypatch):
    monkeypatch.setattr(queries, "MAX_HISTORY_VALUES", 1000)
    run = h.create_run()
    h.send(run["id"], [report(s, scalars={f"s{i}": float(s) for i in range(10)}) for s in range(120)])
    path = f"/v1/runs/{run['id']}/history"
    for encoding in ("json", "f64"):
        msg = detail(h, path, 422, encoding=encoding)
        assert "1200 values" in msg and "0 layer values and 1200 scalar values" in msg, msg
        assert "more than 1000, the most one answer may hold" in msg and "start" in msg, msg
    within = h.get(path, metrics="s0,s1,s2")["metrics"]  # 360 values
    assert within["s2"]["steps"] == list(range(120)) and within["s2"]["layers"] == [-1]
    assert h.get(path, end=49)["metrics"]["s9"]["steps"] == list(range(50))  # 500 values


def test_history_counts_layer_values_and_scalars_together(h, monkeypatch):
    monkeypatch.setattr(queries, "MAX_HISTORY_VALUES", 1000)
    run = h.create_run()
    h.send(run["id"], [report(s, {"qkai": [0.5] * 4}, scalars={"loss": 2.0}) for s in range(210)])
    path = f"/v1/runs/{run['id']}/history"
    msg = detail(h, path, 422)  # 840 layer values + 210 scalars: each alone is within the bound
    assert (
        "1050 values (840 layer values and 210 scalar values)" in msg
        and "more than 1000, the most one answer may hold" in msg
    ), msg
    assert set(h.get(path, metrics="qkai")["metrics"]) == {"qkai"}
    assert set(h.get(path, metrics="loss")["metrics"]) == {"loss"}


# --- L1: means of huge finite values are finite -------------------------------------------------


def huge_run(h, steps: int = 2000) -> str:
    """A run whose every kind of value is 1.7e308 at each of ``steps`` steps: a scalar, a layer value
    (read from the frames), two heads (read from the points), and two scalars that make a plain
    mean fail in other ways."""
    run = h.create_run()
    h.send(
        run["id"],
        [
            report(
                s,
                {"wide": [HUGE, HUGE]},
                heads={"wide": [[HUGE, HUGE], [HUGE, -HUGE]]},
                scalars={
                    "big": HUGE,
                    "spread": 1e200 if s % 2 else 3e200,  # PostgreSQL's avg overflows its sum of squares
                    "mixed": 5e-324 if s % 2 else MAX,  # scaling the smallest value down would underflow
                },
            )
            for s in range(steps)
        ],
    )
    return run["id"]


def test_a_downsampled_series_of_huge_values_has_finite_means(h):
    run = huge_run(h)
    s = h.get(f"/v1/runs/{run}/series", metric="big", max_points=10)
    assert s["downsampled"] and len(s["steps"]) == 10
    assert s["values"] == [HUGE] * 10 and s["min"] == [HUGE] * 10 and s["max"] == [HUGE] * 10
    spread = h.get(f"/v1/runs/{run}/series", metric="spread", max_points=10)["values"]
    assert spread == pytest.approx([2e200] * 10, rel=1e-12)
    mixed = h.get(f"/v1/runs/{run}/series", metric="mixed", max_points=10)["values"]
    assert mixed == pytest.approx([MAX / 2] * 10, rel=1e-12)
    layer = h.get(f"/v1/runs/{run}/series", metric="wide", layer=1, max_points=7)
    assert layer["values"] == [HUGE] * 7


def test_compare_of_huge_values_is_finite(h):
    a, b = huge_run(h, 400), huge_run(h, 400)
    body = h.get("/v1/compare", run=[a, b], metric="big", max_points=10)
    assert [s["values"] for s in body["series"]] == [[HUGE] * 10, [HUGE] * 10]


def test_mean_heatmaps_of_huge_values_are_finite(h):
    run = huge_run(h)
    layers = h.get(f"/v1/runs/{run}/heatmap", metric="wide", agg="mean", max_steps=10)  # from the frames
    assert layers["downsampled"] and layers["values"] == [[HUGE, HUGE]] * 10
    for head, expected in ((0, [HUGE, HUGE]), (1, [HUGE, -HUGE])):  # per head: from the points, in SQL
        heads = h.get(f"/v1/runs/{run}/heatmap", metric="wide", agg="mean", max_steps=10, head=head)
        assert heads["values"] == [expected] * 10, head


def test_infinities_keep_their_meaning_in_a_mean(h):
    """A bucket with +inf among finite values averages to +inf; with +inf and -inf, to NaN."""
    run = h.create_run()
    values = ["inf", 1.0] * 5 + ["inf", "-inf"] * 5 + [-MAX, "-inf"] * 5
    h.send(run["id"], [report(s, {"wide": [v]}, scalars={"edge": v}) for s, v in enumerate(values)])
    series = h.get(f"/v1/runs/{run['id']}/series", metric="edge", max_points=3)
    assert series["values"] == ["inf", "nan", "-inf"]
    assert series["min"] == [1.0, "-inf", "-inf"] and series["max"] == ["inf", "inf", -MAX]
    heatmap = h.get(f"/v1/runs/{run['id']}/heatmap", metric="wide", agg="mean", max_steps=3)
    assert heatmap["values"] == [["inf"], ["nan"], ["-inf"]]


def test_ordinary_means_are_unchanged(h):
    run = h.create_run()
    values = [0.1 * s + (1000.0 if s % 3 == 0 else 0.0) for s in range(40)]
    h.send(run["id"], [report(s, {"wide": [v, -v]}, scalars={"x": v}) for s, v in enumerate(values)])
    series = h.get(f"/v1/runs/{run['id']}/series", metric="x", max_points=4)["values"]
    expected = [math.fsum(values[i : i + 10]) / 10 for i in range(0, 40, 10)]
    assert series == pytest.approx(expected, rel=1e-15, abs=0)
    heatmap = h.get(f"/v1/runs/{run['id']}/heatmap", metric="wide", agg="mean", max_steps=4)["values"]
    assert [row[0] for row in heatmap] == pytest.approx(expected, rel=1e-15, abs=0)
    assert [row[1] for row in heatmap] == pytest.approx([-e for e in expected], rel=1e-15, abs=0)
