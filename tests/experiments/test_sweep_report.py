"""docs/instability.md as the sweep's results make it: the page says what the numbers say, either way."""

from __future__ import annotations

import copy
from typing import Any

from experiments.early_warning.sweep_report import page
from tests.experiments.test_sweep_analysis import synthetic_board


def results(**more: Any) -> dict[str, Any]:
    return {**synthetic_board(), "collapse_threshold": 0.7, "forecast_baseline": None, **more}


def test_the_page_names_what_meets_the_bar_on_the_held_out_seed() -> None:
    text = page(results())
    # x_high: 1 of 1 flagged, 599 steps ahead, no false alarm; so is the rate baseline, 799 ahead: a tie
    assert "`x_high`, `any chosen or collapse rule` meet the bar but do not beat every baseline" in text
    assert "so no rule ships as a default" in text and "Baselines meeting the bar: `lr >= 0.3`." in text
    assert "| x_high | 1/1 (100 %) | 599 | 0/2 | yes | no |" in text
    assert "| detectors.yml:x_low | 1/1 (100 %) | 799 | 1/2 | no | no |" in text  # untuned, fires on the healthy run
    assert "| loss-only alert (baseline) | 0/1 (0 %) | - | 0/2 | no | - |" in text
    assert "no run reported QKAI" in text  # the page computes it; it does not assume it
    assert "Not measured yet" in text


def test_a_rule_that_beats_every_baseline_and_meets_the_bar_is_named_a_default() -> None:
    r = results()
    held = r["tables"]["holdout"]
    held["lr >= 0.3"].update(flagged=0, meets_bar=False)  # as if the rate baseline had missed the bad run
    for name in ("x_high", "any chosen or collapse rule"):
        held[name].update(beats_baselines=True, default=True)
    assert "`x_high`, `any chosen or collapse rule` meet the bar and beat the baselines" in page(r)


def test_the_page_says_so_when_nothing_meets_the_bar() -> None:
    r = results()
    for row in r["tables"]["holdout"].values():
        row.update(meets_bar=False, default=False)
    assert "no qkwatch rule meets the bar, so none ships as a default" in page(r)


def forecast(beats: bool) -> dict[str, Any]:
    return {
        "rule": {"name": "qkai_forecast", "kind": "forecast", "window": 24},
        "threshold": 0.7,
        "constant_guess_step": 465.0,
        "test_runs": ["a", "b"],
        "scored": 4,
        "forecast_median_error": 0.2 if not beats else 0.03,
        "constant_median_error": 0.05,
        "forecast_wins": 1 if not beats else 3,
        "difference_interval": [0.05, 0.2] if not beats else [-0.04, -0.01],
        "median_lead_steps": 90,
        "never_crossed": 0,
        "crossings_without_forecast": [],
        "test_layers_crossed": 6,
        "forecast_beats_constant": beats,
    }


def test_the_forecast_section_gives_the_verdict_the_numbers_give() -> None:
    lost = page(results(forecast_baseline=forecast(False)))
    assert "**The forecast does not beat the constant guess on the held-out seeds**" in lost
    assert "| qkai_forecast | 20 % | 4 forecasts, 2 runs |" in lost and "| constant guess | 5 % |" in lost
    assert "at step 465" in lost and "+0.05 to +0.20" in lost
    won = page(results(forecast_baseline=forecast(True)))
    assert "**The forecast beats the constant guess on the held-out seeds**" in won


def test_qkai_crossings_are_counted_from_the_runs_peaks() -> None:
    r = copy.deepcopy(results())
    for i, run in enumerate(r["runs"]):
        run["peaks"]["qkai"] = 0.25 + 0.1 * i  # 0.25 ... 0.75: the last run past 0.7 (0.65 is not)
    text = page(r)
    assert "1 of 6 runs raised QKAI past the collapse threshold on their own (largest 0.750)" in text
    for run in r["runs"]:
        run["peaks"]["qkai"] = 0.42
    assert (
        "No run here raised QKAI past the collapse threshold on its own (the largest, over every run, layer "
        "and report: 0.420)" in page(r)
    )
