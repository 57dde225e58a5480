"""The instability suite's machinery, on a two-run miniature (CI trains no more than this).

Two tiny runs are trained into a real collector (``qkwatch serve``) through the agent, read back
over REST, labelled by the outcome rule, scored through the backtest with every detector family,
and written up as the page; the miniature checks the plumbing and the page's honesty (what it
says follows from the results), not the suite's findings.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import experiments.common
from experiments import instability
from experiments.early_warning import detectors, forecast_study, instability_forecast_report
from experiments.early_warning.instability_report import page
from qkwatch.rules.transitions import ReportValues

pytestmark = pytest.mark.timeout(600)

MINI = """
runs:
  - {name: mini-a, recipe: debug_cpu, seed: 0, split: tune, pressure: learning rate, variant: vanilla,
     sets: [optim.lr=3.0e-3, train.steps=30, train.report_every=3, train.val_every=30, raa.enabled=false]}
  - {name: mini-b, recipe: debug_cpu, seed: 1, split: test, pressure: learning rate, variant: vanilla,
     sets: [optim.lr=3.0e-3, train.steps=30, train.report_every=3, train.val_every=30, raa.enabled=false]}
"""


def test_a_two_run_miniature_trains_scores_and_writes_its_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    runs = tmp_path / "runs.yml"
    runs.write_text(MINI)
    monkeypatch.setattr(experiments.common, "RESULTS", tmp_path / "results")
    argv = [
        "--runs",
        str(runs),
        "--root",
        str(tmp_path / "campaign"),
        "--campaign",
        "mini",
        "--docs",
        str(tmp_path / "docs"),
        "--no-png",
        "--results",
        "mini",
    ]
    assert instability.main(argv) == 0
    results = json.loads((tmp_path / "results" / "mini.json").read_text())
    by_name = {r["name"]: r for r in results["runs"]}
    assert set(by_name) == {"mini-a", "mini-b"}
    for run in by_name.values():
        assert run["loss_steps"] == 30  # every step's loss reached the collector
        assert run["reports"] == 10 and run["outcome"] in ("healthy", "spiked", "diverged")
        assert run["val_loss"] is not None and run["loss_curve"][0][0] == 0
    assert results["outcome_rule"] == "delta=0.5,for=5,window=20"
    assert {s["rule"] for s in results["test"]["scores"]} >= {"qkai_high", "collapse_band", "(any rule)"}
    assert set(results["candidates_on_test"]) == set(detectors.FAMILIES)
    text = (tmp_path / "docs" / "instability-earlier.md").read_text()
    assert "`delta=0.5,for=5,window=20`" in text and "Of 2 runs," in text
    assert instability.main([*argv, "--report"]) == 0  # the page again, from the results alone
    assert (tmp_path / "docs" / "instability-earlier.md").read_text() == text


def test_the_page_says_the_bar_is_not_met_when_it_is_not() -> None:
    results = {
        "outcome_rule": "delta=0.5,for=5,window=20",
        "collapse_threshold": 0.7,
        "families": {"f": []},
        "chosen": {},
        "runs": [
            {
                "name": "a",
                "split": "test",
                "pressure": "learning rate",
                "variant": "vanilla",
                "induced": False,
                "outcome": "diverged",
                "outcome_step": 50,
                "why": "loss nan at step 50",
                "loss_curve": [[0, 5.0]],
            }
        ],
        "tune": {"scores": [], "runs": []},
        "test": {
            "scores": [
                {
                    "rule": "(any rule)",
                    "bad_runs": 1,
                    "flagged": 0,
                    "late": 1,
                    "recall": 0.0,
                    "healthy_runs": 0,
                    "false_alarms": 0,
                    "unknown_runs": 0,
                    "median_lead_steps": None,
                    "median_lead_reports": None,
                }
            ],
            "runs": [],
        },
        "forecast": [],
        "lr_sensitivity": {},
        "contraction": [],
    }
    text, _ = page(results, "")
    assert "flagged 0 of 1 bad test runs" in text and "**Not met.**" in text
    assert "No forecast fired in the suite" in text and "Of 1 runs, 1 diverged" in text


def _line_run(name: str, values: dict[int, float]) -> SimpleNamespace:
    """A stand-in for RunData: what forecast_tuning reads (the run's name, its reports)."""
    reports = [ReportValues(1, step, {"qkai": [0.3, v]}) for step, v in sorted(values.items())]
    return SimpleNamespace(run=SimpleNamespace(name=name), history=SimpleNamespace(reports=reports))


def test_the_forecast_is_chosen_on_tune_by_its_rule_and_only_then_measured_on_test() -> None:
    """Tune: layer 1 rises 0.002/step from 0.30 (reports every 5 steps): every line predicts 200 and the
    first report above 0.70 is 205, so the error is 5 / (205 - fired), lowest for the earliest firing,
    which the smallest window (6 reports: step 25) with a horizon that reaches (250) makes. Test: a steeper
    rise (0.004/step: predicted 100, actual 105) that only the chosen rule is measured on."""
    tune = [_line_run("tune", {s: 0.30 + 0.002 * s for s in range(0, 400, 5)})]
    test = [_line_run("test", {s: 0.30 + 0.004 * s for s in range(0, 200, 5)})]
    out = forecast_study.forecast_tuning(tune, test, 0.70)  # type: ignore[arg-type]
    assert out["chosen"] == {
        **forecast_study.FORECAST_GRID[0],
        "window": 6,
        "horizon_steps": 250,
        "for_reports": 1,
        "fit": "least_squares",
        "margin": 0.0,
    }
    assert out["tune_median"] == pytest.approx(5 / 180) and out["tune_median_lead_steps"] == 180
    by_rule = {json.dumps(c["rule"], sort_keys=True): c for c in out["candidates"]}
    assert len(by_rule) == len(forecast_study.FORECAST_GRID)
    for c in out["candidates"]:  # eligible: crossed on every tune run, with a median lead of at least 25 steps
        lead = c["tune_median_lead_steps"]
        assert c["eligible"] == (lead is not None and lead >= forecast_study.FORECAST_MIN_LEAD_STEPS)
        if c["eligible"]:
            assert c["tune_median"] >= out["tune_median"]
    assert {x["rule"] for x in out["test"]} == {"qkai_forecast"} and out["test_runs"] == ["test"]
    assert [(x["fired"], x["predicted"], x["actual"]) for x in out["test"]] == [(25, 100, 105)]
    assert out["test_median"] == pytest.approx(5 / 80)


def test_no_forecast_is_chosen_that_misses_a_tune_run_or_looks_ahead_too_little() -> None:
    """A flat tune run leaves every candidate out (none crossed there); so does a jump of 0.03/step from
    step 300 (0.45, 0.60, 0.75): a line sees it at most 10 steps before the crossing at 315."""
    flat = _line_run("flat", {s: 0.30 for s in range(0, 400, 5)})
    rising = _line_run("rising", {s: 0.30 + 0.002 * s for s in range(0, 400, 5)})
    late = _line_run("late", {s: 0.30 + 0.03 * max(s - 300, 0) for s in range(0, 400, 5)})
    for tune in ([flat, rising], [late]):
        out = forecast_study.forecast_tuning(tune, [rising], 0.70)  # type: ignore[arg-type]
        assert out["chosen"] is None and out["test"] == [] and not any(c["eligible"] for c in out["candidates"])
    leads = [c["tune_median_lead_steps"] for c in out["candidates"] if c["tune_crossed"]]
    assert leads and max(leads) <= 10


def test_the_first_forecast_attempt_is_shown_with_its_miss() -> None:
    """The committed first protocol (chosen on 4 collapse seeds, judged on 4 others) stays on the page as a
    miss, its figures read from its results file."""
    first = json.loads((Path(__file__).resolve().parents[2] / instability_forecast_report.FIRST_FORECAST).read_text())
    text = instability_forecast_report.first_forecast_section()
    crossed = [x for x in first["test"] if x["relative_error"] is not None]
    assert f"median **{round(100 * first['test_median'])} %** over {len(crossed)} forecasts" in text
    assert "**not within 25 %.**" in text and first["test_median"] > 0.25
    assert f"{sum(x['layer_crossed_before'] for x in crossed)} of those forecast a layer that had crossed" in text
