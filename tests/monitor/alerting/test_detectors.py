"""The detector kinds, pure: thresholds below a value, entropy both ways, growth and forecast.

Inputs are closed forms whose answers are known: a baseline and a growth that reach the factor at
a known report; a linear ramp that crosses the threshold at a known step, which the forecast must
predict exactly.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from qkwatch.contract.responses import AlertPublic
from qkwatch.monitor.alerting.notifier import alertmanager_payload
from qkwatch.monitor.alerting.records import PendingNotification
from qkwatch.rules.forecast import fit_line
from qkwatch.rules.kinds import ForecastRule, GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import LayerState, ReportValues, Transition, evaluate


def series(metric: str, values: list[float | None], *, every: int = 1, start: int = 0, attempt: int = 1):
    """One report per value, ``every`` steps apart, the value on layer 0."""
    return [ReportValues(attempt, start + every * i, {metric: [v]}) for i, v in enumerate(values)]


def brief(out: list[Transition]) -> list[tuple]:
    return [(t.kind, t.rule, t.layers, t.onset_step, t.step, t.predicted_step) for t in out]


# ---- thresholds below a value, entropy both ways ------------------------------------------------


def test_stable_rank_below_a_value_fires_and_resolves() -> None:
    rules = RuleSet((ThresholdRule("stable_rank_low", "stable_rank", "<", 1.2, for_reports=2),), ())
    out = evaluate(rules, {}, series("stable_rank", [1.6, 1.19, 1.15, 1.1, 1.2, 1.1], every=25))
    assert brief(out) == [
        ("firing", "stable_rank_low", (0,), 25, 50, None),
        ("resolved", "stable_rank_low", (0,), 25, 100, None),  # 1.2 is not below 1.2
    ]
    assert out[0].summary == "layer 0: stable_rank < 1.2 for 2 consecutive reports (1.15 at onset)"


def test_attention_entropy_is_watched_both_ways() -> None:
    rules = RuleSet(
        (
            ThresholdRule("attn_uniform", "attn_entropy", ">", 0.98, for_reports=2),
            ThresholdRule("attn_one_hot", "attn_entropy", "<", 0.1, for_reports=2),
        ),
        (),
    )
    rows = [[0.6, 0.99, 0.05], [0.6, 0.995, 0.02], [0.6, 1.0, 0.01]]  # layer 1 uniform, layer 2 one-hot
    out = evaluate(rules, {}, [ReportValues(1, 10 * i, {"attn_entropy": row}) for i, row in enumerate(rows)])
    assert brief(out) == [
        ("firing", "attn_uniform", (1,), 0, 10, None),
        ("firing", "attn_one_hot", (2,), 0, 10, None),
    ]


# ---- growth ------------------------------------------------------------------------------------


GROWTH = GrowthRule("logit_growth", factor=3.0, baseline_reports=3, skip_reports=1, for_reports=2)


def test_growth_fires_at_the_report_that_completes_its_streak() -> None:
    """Skipped: 100 (at init). Baseline: mean(10, 12, 14) = 12. 36 = 3.0x starts the streak, 40 completes it."""
    values = [100.0, 10.0, 12.0, 14.0, 20.0, 36.0, 40.0, 48.0, 30.0]
    state: dict = {}
    out = evaluate(RuleSet((), (), growths=(GROWTH,)), state, series("logit_max", values, every=10))
    assert brief(out) == [
        ("firing", "logit_growth", (0,), 50, 60, None),
        ("resolved", "logit_growth", (0,), 50, 80, None),
    ]
    assert out[0].summary == "layer 0: logit_max 3.3x its early value (40 vs 12; fires at 3x for 2 consecutive reports)"
    assert out[1].summary == "layer 0: logit_max back to 2.5x its early value (30 vs 12)"
    assert state[("logit_growth", 0)].memory == {"skipped": 1, "early": [10.0, 12.0, 14.0]}  # bounded: done


def test_the_baseline_takes_finite_values_only_and_a_nan_is_no_growth() -> None:
    rule = GrowthRule("g", factor=2.0, baseline_reports=2, for_reports=1)
    values = [math.nan, 4.0, math.inf, 8.0, math.nan, 12.0, math.inf]  # baseline mean(4, 8) = 6
    out = evaluate(RuleSet((), (), growths=(rule,)), {}, series("logit_max", values))
    assert brief(out) == [("firing", "g", (0,), 5, 5, None)]  # 12 = 2x; the NaN at step 4 did not fire
    assert "2.0x its early value (12 vs 6;" in out[0].summary
    # inf at step 6 is growth: the alert stays firing (no second transition)


def test_a_factor_below_one_watches_a_fall_from_the_early_value() -> None:
    """Skipped: 9 (at init). Baseline: mean(4, 4) = 4. 2 = 0.5x starts the streak, 1.6 (0.4x) completes it;
    3 (0.75x) resolves; inf and NaN are no fall."""
    rule = GrowthRule("stable_rank_fall", metric="stable_rank", factor=0.5, baseline_reports=2, skip_reports=1)
    rule = GrowthRule(**{**rule.__dict__, "for_reports": 2})
    values = [9.0, 4.0, 4.0, 2.1, 2.0, 1.6, 3.0, math.inf, math.nan]
    out = evaluate(RuleSet((), (), growths=(rule,)), {}, series("stable_rank", values, every=10))
    assert brief(out) == [
        ("firing", "stable_rank_fall", (0,), 40, 50, None),
        ("resolved", "stable_rank_fall", (0,), 40, 60, None),
    ]
    assert out[0].summary == (
        "layer 0: stable_rank 0.4x its early value (1.6 vs 4; fires at 0.5x or below for 2 consecutive reports)"
    )
    assert rule.holds(0.5) and not rule.holds(0.51) and GROWTH.holds(3.0) and not GROWTH.holds(2.99)


@pytest.mark.parametrize("early", [[-2.0, 0.0], [0.0, 0.0]])
def test_a_layer_without_a_positive_baseline_is_not_judged(early: list[float]) -> None:
    """Baseline -1: -5 and -50 are 5x and 50x of it, which is no growth; baseline 0: no ratio at all."""
    rule = GrowthRule("g", metric="logit_mean", factor=2.0, baseline_reports=2, for_reports=1)
    assert evaluate(RuleSet((), (), growths=(rule,)), {}, series("logit_mean", [*early, -5.0, -50.0, 5.0])) == []


def test_each_layer_has_its_own_baseline() -> None:
    rule = GrowthRule("g", factor=2.0, baseline_reports=1, for_reports=1)
    rows = [[1.0, 10.0], [2.5, 15.0], [3.0, 25.0]]
    out = evaluate(
        RuleSet((), (), growths=(rule,)), {}, [ReportValues(1, i, {"logit_max": r}) for i, r in enumerate(rows)]
    )
    assert brief(out) == [("firing", "g", (0,), 1, 1, None), ("firing", "g", (1,), 2, 2, None)]


def test_growth_of_values_near_the_top_of_the_double_range_is_judged_not_an_overflow() -> None:
    """fsum(1.7e308, 1.7e308, 1.7e308) overflows; the baseline is their mean, 1.7e308, and 1.7e308 is 1.0x of it."""
    rule = GrowthRule("g", factor=2.0, baseline_reports=3, for_reports=1)
    out = evaluate(RuleSet((), (), growths=(rule,)), {}, series("logit_max", [1.7e308] * 4 + [1.0, 1.7e308]))
    assert out == []
    # baseline mean(1e307, 1.7e308) = 9e307 (their sum, 1.8e308, is past the largest double); 1.79e308 is 1.99x
    big = GrowthRule("g", factor=1.5, baseline_reports=2, for_reports=1)
    out = evaluate(RuleSet((), (), growths=(big,)), {}, series("logit_max", [1e307, 1.7e308, 1.79e308]))
    assert brief(out) == [("firing", "g", (0,), 2, 2, None)]
    assert "2.0x its early value (1.79e+308 vs 9e+307;" in out[0].summary


# ---- forecast ----------------------------------------------------------------------------------


def ramp(step: int) -> float:
    """0.25 + step / 2048: exact in binary, crosses 0.75 at step 1024."""
    return 0.25 + step / 2048


def test_a_linear_ramp_is_forecast_to_cross_at_its_exact_step() -> None:
    rule = ForecastRule("fc", horizon_steps=200, threshold=0.75, window=5)
    state: dict = {}
    steps = range(0, 1100, 16)
    out = evaluate(RuleSet((), (), forecasts=(rule,)), state, [ReportValues(1, s, {"qkai": [ramp(s)]}) for s in steps])
    # first report with the crossing at most 200 steps ahead: 1024 - 832 = 192
    assert brief(out) == [("firing", "fc", (0,), 832, 832, 1024), ("resolved", "fc", (0,), 832, 1040, None)]
    assert out[0].summary == (
        "layer 0: qkai 0.656 rising 0.00049/step, crosses 0.75 in about 190 steps (at step ~1024)"
    )
    # at 1024 the value is 0.75, not above it; at 1040 it is, and the threshold rule takes over
    assert out[1].summary == "layer 0: qkai crossed 0.75: 0.7578 at step 1040 (forecast: step ~1024)"
    memory = state[("fc", 0)].memory
    assert [x for x, _ in memory["points"]] == [1024, 1040, 1056, 1072, 1088] and "predicted" not in memory


def test_the_summary_says_when_in_steps_and_at_which_step() -> None:
    """The collapse threshold by default; the issue's own example: 0.58 rising 0.0004/step reaches 0.70 at 1450."""
    rule = ForecastRule("qkai_forecast", horizon_steps=500, window=5)
    steps = range(950, 1151, 50)
    reports = [ReportValues(1, s, {"qkai": [0.3, 0.3, 0.3, 0.58 + 0.0004 * (s - 1150)]}) for s in steps]
    (t,) = evaluate(RuleSet((), (), forecasts=(rule,)), {}, reports)
    assert (t.kind, t.layers, t.step, t.predicted_step) == ("firing", (3,), 1150, 1450)
    assert t.summary == "layer 3: qkai 0.58 rising 0.0004/step, crosses 0.70 in about 300 steps (at step ~1450)"


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ([0.5, 0.55, 0.6, 0.65], "fewer points than the window"),
        ([0.69, 0.68, 0.67, 0.66, 0.65], "heading away"),
        ([0.3, 0.31, 0.32, 0.33, 0.34], "crossing beyond the horizon (step 40)"),
        ([0.6, 0.65, 0.69, 0.72, 0.8], "already past: the threshold rule's job"),
        ([0.5, 0.55, 0.6, 0.65, math.nan], "not measurable"),
    ],
)
def test_no_forecast_fires(values: list[float], why: str) -> None:
    rule = ForecastRule("fc", horizon_steps=5, window=5)
    assert evaluate(RuleSet((), (), forecasts=(rule,)), {}, series("qkai", values)) == [], why


def test_theil_sen_passes_over_a_jump_that_bends_least_squares() -> None:
    """Five points on y = 0.40 + 0.01 x, the last one jumped by 0.15: the median of the 10 pairwise
    slopes is 0.01 (the 4 slopes to the jumped point are all larger), so Theil-Sen crosses 0.70 at
    x = 30, as the line does; least squares (numpy's polyfit, independently) tilts toward the jump."""
    points = [(x, 0.40 + 0.01 * x) for x in range(5)]
    points[-1] = (4, points[-1][1] + 0.15)
    ts = fit_line(ForecastRule("fc", horizon_steps=100, window=5, fit="theil_sen"), points)
    ls = fit_line(ForecastRule("fc", horizon_steps=100, window=5), points)
    assert ts is not None and ls is not None
    assert ts.slope == pytest.approx(0.01) and ts.crossing == pytest.approx(30.0)
    a, b = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    assert ls.slope == pytest.approx(a) and ls.crossing == pytest.approx((0.70 - b) / a)
    assert ls.crossing < 20  # the jump makes least squares say the crossing is half as far


def test_a_margin_predicts_where_the_noise_first_reaches_the_threshold() -> None:
    """The target is the threshold less margin x the residuals' standard deviation (n - 2 degrees of
    freedom), checked against numpy; falling rules move it up instead."""
    ys = [0.50, 0.53, 0.52, 0.56, 0.55, 0.59]
    points = list(enumerate(ys))
    a, b = np.polyfit(range(6), ys, 1)
    sd = float(np.sqrt(np.sum((np.array(ys) - (a * np.arange(6) + b)) ** 2) / 4))
    for margin in (0.0, 1.0, 2.0):
        fc = fit_line(ForecastRule("fc", horizon_steps=100, window=6, margin=margin), points)
        assert fc is not None and fc.crossing == pytest.approx((0.70 - margin * sd - b) / a)
    down = [(x, 2 - y) for x, y in points]  # the same line upside down, falling toward 1.30
    fc = fit_line(
        ForecastRule("sr", metric="stable_rank", op="<", threshold=1.30, horizon_steps=100, window=6, margin=1.0),
        down,
    )
    assert fc is not None and fc.crossing == pytest.approx((0.70 - sd - b) / a)


def test_a_falling_forecast_and_for_reports() -> None:
    """Stable rank falling 0.1 per step toward 1.23: crosses at step 7.7; within a horizon of 4 from step 4 on."""
    rule = ForecastRule("sr", metric="stable_rank", op="<", threshold=1.23, horizon_steps=4, window=3, for_reports=2)
    values = [2.0 - 0.1 * s for s in range(8)]
    (t,) = evaluate(RuleSet((), (), forecasts=(rule,)), {}, series("stable_rank", values))
    assert (t.kind, t.onset_step, t.step, t.predicted_step) == ("firing", 4, 5, 8)
    assert t.summary == "layer 0: stable_rank 1.5 falling 0.1/step, crosses 1.23 in about 3 steps (at step ~8)"


def test_a_line_already_past_the_threshold_crosses_about_now() -> None:
    """The line through (0.30, 0.69, 0.695) crosses 0.70 at step 1.7, behind the latest report (step 2),
    whose value is not above 0.70 yet: the forecast says now, not a step in the past."""
    rule = ForecastRule("fc", horizon_steps=10, window=3)
    out = evaluate(RuleSet((), (), forecasts=(rule,)), {}, series("qkai", [0.30, 0.69, 0.695]))
    assert brief(out) == [("firing", "fc", (0,), 2, 2, 2)]
    assert out[0].summary == "layer 0: qkai 0.695 rising 0.2/step, crosses 0.70 about now (at step ~2)"


def test_a_layer_that_crossed_gets_no_forecast_again_until_a_resume_from_before_it() -> None:
    """Rising, past 0.70 at step 3, back under it and rising again: the forecast warned once, before
    step 3, and says nothing of the dips after (qkai_high speaks for the layer). A resume from step 2
    (a new attempt) replaces the crossing (and the window, whose points all lay after it): the layer is
    forecast again once the window holds 2 points of the new attempt."""
    rule = ForecastRule("fc", horizon_steps=10, window=2)
    rules = RuleSet((), (), forecasts=(rule,))
    state: dict = {}
    out = evaluate(rules, state, series("qkai", [0.50, 0.60, 0.65, 0.75, 0.66, 0.69, 0.68, 0.695]))
    assert brief(out) == [("firing", "fc", (0,), 1, 1, 2), ("resolved", "fc", (0,), 1, 3, None)]
    assert state[("fc", 0)].memory["crossed"] == 3
    resumed = evaluate(rules, state, series("qkai", [0.62, 0.66], start=2, attempt=2))
    assert brief(resumed) == [("firing", "fc", (0,), 3, 3, 4)]
    assert "crossed" not in state[("fc", 0)].memory


def test_a_forecast_resolves_when_the_trend_flattens() -> None:
    rule = ForecastRule("fc", horizon_steps=10, window=3)
    values = [0.5, 0.55, 0.6, 0.6, 0.6, 0.6]
    out = evaluate(RuleSet((), (), forecasts=(rule,)), {}, series("qkai", values))
    # step 3: the line through 0.55, 0.6, 0.6 still crosses at ~6.7; step 4: flat
    assert brief(out) == [("firing", "fc", (0,), 2, 2, 4), ("resolved", "fc", (0,), 2, 4, None)]
    assert out[1].summary == "layer 0: qkai 0.6 no longer forecast to cross 0.70 within 10 steps"


def test_a_resumed_attempt_drops_the_points_it_replaced() -> None:
    """Attempt 1 rose up to step 9 (window: 6-9); attempt 2 resumes at step 5: its window must not keep 6-9."""
    rule = ForecastRule("fc", horizon_steps=100, window=4)
    state: dict = {}
    rules = RuleSet((), (), forecasts=(rule,))
    evaluate(rules, state, series("qkai", [0.1 + 0.05 * s for s in range(10)]))
    assert state[("fc", 0)].firing
    out = evaluate(rules, state, series("qkai", [0.3, 0.3], start=5, attempt=2))
    assert [x for x, _ in state[("fc", 0)].memory["points"]] == [5, 6]
    assert brief(out) == [("resolved", "fc", (0,), 3, 5, None)]  # one point is no forecast


def test_the_window_is_bounded() -> None:
    rule = ForecastRule("fc", horizon_steps=1, window=6)
    state: dict = {}
    evaluate(RuleSet((), (), forecasts=(rule,)), state, series("qkai", [0.1] * 50))
    assert len(state[("fc", 0)].memory["points"]) == 6


# ---- exactly once, and the same in pieces --------------------------------------------------------


def every_kind() -> RuleSet:
    return RuleSet(
        thresholds=(ThresholdRule("qkai_high", threshold=0.7), ThresholdRule("sr_low", "stable_rank", "<", 1.2, 2)),
        bands=(),
        growths=(GrowthRule("logit_growth", factor=3.0, baseline_reports=3, for_reports=2),),
        forecasts=(ForecastRule("qkai_forecast", horizon_steps=60, window=4),),
    )


def a_run(n: int = 40) -> list[ReportValues]:
    """Three layers: layer 1's QKAI ramps through 0.70 at step 138 and its stable rank falls through 1.2 at
    200; layer 2's largest logit grows 1 % of its step-0 value per step."""
    out = []
    for i in range(n):
        step = 10 * i
        out.append(
            ReportValues(
                1,
                step,
                {
                    "qkai": [0.3, 0.355 + 0.0025 * step, 0.3],
                    "stable_rank": [2.0, 2.0 - 0.004 * step, 2.0],
                    "logit_max": [5.0, 5.0, 5.0 * (1 + 0.01 * step)],
                },
            )
        )
    return out


def test_every_kind_fires_on_the_synthetic_run() -> None:
    out = evaluate(every_kind(), {}, a_run())
    firing = {(t.rule, t.layers): t.step for t in out if t.kind == "firing"}
    assert firing == {
        ("qkai_forecast", (1,)): 80,  # the crossing (138) at most 60 steps ahead
        ("qkai_high", (1,)): 160,  # above 0.70 from 140, 3 reports
        ("logit_growth", (2,)): 240,  # baseline mean(5, 5.5, 6) = 5.5; 5 (1 + 0.01 s) >= 16.5 from 230, 2 reports
        ("sr_low", (1,)): 220,  # 2 - 0.004 s < 1.2 from 210, 2 reports
    }
    (forecast,) = [t for t in out if t.rule == "qkai_forecast" and t.kind == "firing"]
    assert forecast.predicted_step == 138


def test_replayed_reports_change_nothing() -> None:
    rules = every_kind()
    state: dict = {}
    first = evaluate(rules, state, a_run())
    before = copy.deepcopy(state)
    assert first and evaluate(rules, state, a_run()) == []
    assert evaluate(rules, state, a_run()[10:20]) == []  # a late batch
    assert state == before


@pytest.mark.parametrize("cuts", [(1,), (3, 17, 18, 30), tuple(range(1, 40))])
def test_the_same_run_in_batches_gives_the_same_transitions(cuts: tuple[int, ...]) -> None:
    rules = every_kind()
    whole = evaluate(rules, {}, a_run())
    state: dict[tuple[str, int], LayerState] = {}
    pieces: list[Transition] = []
    reports = a_run()
    for lo, hi in zip((0, *cuts), (*cuts, len(reports)), strict=True):
        state = copy.deepcopy(state)  # nothing shared between batches but what a store would keep
        pieces += evaluate(rules, state, reports[lo:hi])
    assert pieces == whole


def test_a_forecasts_webhook_carries_its_predicted_step() -> None:
    row = AlertPublic(
        id=1,
        run="rid",
        run_name="r",
        project="p",
        rule="qkai_forecast",
        severity="warning",
        state="firing",
        metric="qkai",
        layers=[3],
        summary="crosses",
        onset_step=1150,
        resolved_step=None,
        starts_at=0.0,
        ends_at=None,
    )
    plain = alertmanager_payload(PendingNotification(1, 0, "firing", row), "http://collector")
    assert "predicted_step" not in plain["alerts"][0]["annotations"]
    forecast = PendingNotification(1, 0, "firing", row.model_copy(update={"predicted_step": 1450}))
    assert alertmanager_payload(forecast, "http://collector")["alerts"][0]["annotations"]["predicted_step"] == "1450"


def test_a_ramp_near_the_top_of_the_double_range_is_forecast_at_its_exact_step() -> None:
    """The ramp of the test above times 2^1023 (values about 5e307) against the threshold 0.75 x 2^1023:
    the same crossing step, 1024, where the unscaled sums would overflow."""
    k = 2.0**1023
    rule = ForecastRule("fc", metric="logit_max", horizon_steps=200, threshold=0.75 * k, window=5)
    steps = range(0, 1100, 16)
    out = evaluate(
        RuleSet((), (), forecasts=(rule,)), {}, [ReportValues(1, s, {"logit_max": [ramp(s) * k]}) for s in steps]
    )
    assert brief(out) == [("firing", "fc", (0,), 832, 832, 1024), ("resolved", "fc", (0,), 832, 1040, None)]
