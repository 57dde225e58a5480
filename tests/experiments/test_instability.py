"""The instability suite's machinery, on a two-run miniature (CI trains no more than this).

Two tiny runs are trained into a real collector (``qkwatch serve``) through the agent, read back
over REST, labelled by the outcome rule, scored through the backtest with every detector family,
and written up as the page; the miniature checks the plumbing and the page's honesty (what it
says follows from the results), not the suite's findings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import experiments.common
from experiments import instability
from experiments.instability_report import page

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
    assert set(results["candidates_on_test"]) == set(instability.FAMILIES)
    text = (tmp_path / "docs" / "instability.md").read_text()
    assert "`delta=0.5,for=5,window=20`" in text and "Of 2 runs," in text
    assert instability.main([*argv, "--report"]) == 0  # the page again, from the results alone
    assert (tmp_path / "docs" / "instability.md").read_text() == text


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
