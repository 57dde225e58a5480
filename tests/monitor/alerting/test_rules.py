"""Pure alert rules: step-based persistence, bands, replays, the rules file."""

from __future__ import annotations

import pytest

from qkwatch.rules.kinds import BandRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import ReportValues, band_layers, evaluate


def reports(rows, attempt=1, start=0):
    return [ReportValues(attempt, start + i, {"qkai": row}) for i, row in enumerate(rows)]


def test_fires_on_the_third_consecutive_report_with_onset_at_the_first():
    state = {}
    out = evaluate(RuleSet.default(), state, reports([[0.8], [0.8], [0.8], [0.8]]))
    assert [(t.kind, t.layers, t.onset_step, t.step) for t in out] == [("firing", (0,), 0, 2)]


def test_replayed_reports_are_skipped():
    state = {}
    rules = RuleSet.default()
    evaluate(rules, state, reports([[0.8], [0.8]]))
    assert evaluate(rules, state, reports([[0.8], [0.8]])) == []  # same steps again: not a streak of 4
    assert [t.kind for t in evaluate(rules, state, reports([[0.8]], start=2))] == ["firing"]


def test_a_new_attempt_continues_after_the_checkpoint():
    state = {}
    rules = RuleSet.default()
    evaluate(rules, state, reports([[0.8], [0.8]], start=10))
    out = evaluate(rules, state, reports([[0.8]], attempt=2, start=5))  # resumed at an earlier step
    assert [t.kind for t in out] == ["firing"]


def test_band_needs_adjacent_layers():
    assert band_layers([1, 2, 4, 5, 6, 9], 3) == [4, 5, 6]
    assert band_layers([1, 2, 3, 5, 6, 7], 3) == [1, 2, 3, 5, 6, 7]
    assert band_layers([0, 2, 4], 1) == [0, 2, 4]


def test_band_fires_updates_and_resolves():
    state = {}
    rules = RuleSet.default()
    out = evaluate(rules, state, reports([[0.9, 0.9, 0.9, 0.1]] * 3))
    assert [(t.rule, t.kind, t.layers) for t in out if t.rule == "collapse_band"] == [
        ("collapse_band", "firing", (0, 1, 2))
    ]
    out = evaluate(rules, state, reports([[0.9, 0.9, 0.9, 0.9]] * 3, start=3))
    assert [(t.kind, t.layers) for t in out if t.rule == "collapse_band"] == [("update", (0, 1, 2, 3))]
    out = evaluate(rules, state, reports([[0.9, 0.1, 0.9, 0.9]], start=6))
    assert [(t.kind, t.layers) for t in out if t.rule == "collapse_band"] == [("resolved", (0, 1, 2, 3))]


def test_rules_file_parsing_and_errors():
    rules = RuleSet.from_mapping(
        {
            "rules": [
                {"name": "a", "metric": "attn_entropy", "op": "<", "threshold": 0.2},
                {"name": "b", "band_of": "a", "min_layers": 2},
            ],
            "webhooks": ["http://127.0.0.1:9/x"],
        }
    )
    assert rules.thresholds == (ThresholdRule("a", "attn_entropy", "<", 0.2),)
    assert rules.bands == (BandRule("b", "a", 2),) and rules.webhooks == ("http://127.0.0.1:9/x",)
    for bad, needle in (
        ({"rules": [{"name": "a", "op": "=="}]}, "op"),
        ({"rules": [{"name": "b", "band_of": "x"}]}, "band_of"),
        ({"rules": [{"name": "a", "colour": 1}]}, "colour"),
        ({"alerts": []}, "alerts"),
        ({"rules": [{"name": "a"}, {"name": "a"}]}, "twice"),
        ({"rules": [], "webhooks": ["ftp://x"]}, "webhooks"),
    ):
        with pytest.raises(ValueError, match=needle):
            RuleSet.from_mapping(bad)
