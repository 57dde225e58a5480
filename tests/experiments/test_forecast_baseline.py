"""The forecast against the constant guess, on runs whose crossings are known by construction."""

from __future__ import annotations

import pytest

from experiments.early_warning.instability_data import RunRecord
from experiments.forecast_baseline import compare, constant_guess, crossings
from qkwatch.client.run_history import RunHistory
from qkwatch.rules.transitions import ReportValues

RULE = {
    "name": "f",
    "kind": "forecast",
    "metric": "qkai",
    "op": ">",
    "window": 6,
    "horizon_steps": 100,
    "for_reports": 1,
}


def ramp(name: str, per: int) -> RunRecord:
    """Layer 0's QKAI is ``step / per`` (exactly 0.7 at ``0.7 per``: a division rounds correctly); layer 1
    stays at 0.1. A report every 10 steps to 990."""
    reports = [ReportValues(1, step, {"qkai": [step / per, 0.1]}) for step in range(0, 1000, 10)]
    return RunRecord(name, RunHistory(name, reports, [], []))


def test_crossings_are_the_first_report_strictly_above_the_threshold() -> None:
    assert crossings(ramp("a", 1000), 0.7) == {0: 710}  # 0.7 at step 700 is not above 0.7
    assert crossings(ramp("a", 1000), 0.7, after=710) == {0: 720}  # the first report above, after 710
    assert crossings(ramp("a", 1000), 0.7, after=990) == {}
    # tune crossings 710 and 360 (0.7 at step 350 under 1/500): the guess is their median
    assert constant_guess([ramp("a", 1000), ramp("b", 500)], 0.7) == pytest.approx(535)
    with pytest.raises(ValueError, match="no tune layer crossed"):
        constant_guess([ramp("c", 10_000)], 0.7)


def test_an_exact_line_beats_the_constant_guess_on_a_faster_run() -> None:
    """The test run crosses at 290 (0.7 at step 280 under 1/400): a line through exact points predicts
    280, 10 steps early; the constant guess says 535, 245 steps late."""
    result = compare(RULE, [ramp("a", 1000), ramp("b", 500)], [ramp("t", 400)], 0.7)
    assert result["constant_guess_step"] == 535
    (first, *_) = result["forecasts"]
    assert first["actual"] == 290 and first["predicted"] == 280 and 180 <= first["fired"] < 290
    ahead = 290 - first["fired"]
    assert first["forecast_error"] == pytest.approx(10 / ahead)
    assert first["constant_error"] == pytest.approx(245 / ahead)
    assert result["forecast_beats_constant"] and result["forecast_wins"] == result["scored"] >= 1
    assert result["crossings_without_forecast"] == [] and result["test_layers_crossed"] == 1
    assert result["never_crossed"] == 0


def test_the_constant_guess_wins_when_the_test_run_crosses_where_the_tune_runs_did() -> None:
    """A test run shaped like the tune runs: the guess (710) is exact, the forecast cannot be better."""
    result = compare(RULE, [ramp("a", 1000), ramp("b", 1000)], [ramp("t", 1000)], 0.7)
    assert result["constant_guess_step"] == 710
    assert all(row["constant_error"] == 0 for row in result["forecasts"])
    assert not result["forecast_beats_constant"]
