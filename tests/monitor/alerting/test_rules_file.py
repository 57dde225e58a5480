"""The rules file is validated completely, every field by type, and an empty one is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
from qkwatch.rules.kinds import MEMORY_MAX, ForecastRule, GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet

GOOD = {"name": "r", "metric": "qkai", "op": ">", "threshold": 0.7, "for_reports": 2, "severity": "warning"}
GROWTH = {"name": "g", "kind": "growth", "metric": "logit_max", "factor": 3.0, "baseline_reports": 5}
FORECAST = {"name": "f", "kind": "forecast", "metric": "qkai", "op": ">", "window": 8, "horizon_steps": 500}
DETECTORS = Path(__file__).resolve().parents[3] / "qkwatch" / "dashboards" / "rules" / "detectors.yml"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"rules": 5}, "rules must be a list"),
        ({"rules": "qkai_high"}, "rules must be a list"),
        ({"rules": {"name": "r"}}, "rules must be a list"),
        ({}, "rules: []"),
        ({"webhooks": ["http://hook.example"]}, "rules: []"),
        ({"rules": [{**GOOD, "for_reports": 2.5}]}, "for_reports"),
        ({"rules": [{**GOOD, "for_reports": True}]}, "for_reports"),
        ({"rules": [{**GOOD, "for_reports": "3"}]}, "for_reports"),
        ({"rules": [{**GOOD, "threshold": True}]}, "threshold"),
        ({"rules": [{**GOOD, "threshold": "0.7"}]}, "threshold"),
        ({"rules": [{**GOOD, "metric": "bad metric!"}]}, "metric"),
        ({"rules": [{**GOOD, "metric": 5}]}, "metric"),
        ({"rules": [{**GOOD, "name": 5}]}, "name"),
        ({"rules": [{**GOOD, "name": "has space"}]}, "name"),
        ({"rules": [{**GOOD, "severity": ""}]}, "severity"),
        ({"rules": [{**GOOD, "severity": ["page"]}]}, "severity"),
        ({"rules": [{**GOOD, "op": 1}]}, "op"),
        ({"rules": [GOOD, {"name": "b", "band_of": "r", "min_layers": 1.5}]}, "min_layers"),
        ({"rules": [GOOD, {"name": "b", "band_of": 7}]}, "band_of"),
        ({"rules": [], "webhooks": 5}, "webhooks"),
        ({"rules": [], "webhooks": "http://hook.example"}, "webhooks"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(data: dict, needle: str):
    with pytest.raises(ValueError) as err:
        RuleSet.from_mapping(data)
    assert needle in str(err.value)


def test_an_explicit_empty_list_disables_alerting():
    rules = RuleSet.from_mapping({"rules": [], "webhooks": ["http://hook.example"]})
    assert rules.thresholds == () and rules.bands == () and rules.webhooks == ("http://hook.example",)


def test_a_qkai_rule_without_a_threshold_takes_the_collapse_setting():
    rule = {"name": "r", "metric": "qkai", "for_reports": 2}
    assert RuleSet.from_mapping({"rules": [rule]}, collapse=0.65).thresholds[0].threshold == 0.65
    assert RuleSet.from_mapping({"rules": [{"name": "r"}]}, collapse=0.6).thresholds[0].threshold == 0.6  # metric qkai
    assert RuleSet.from_mapping({"rules": [{**rule, "threshold": 0.9}]}, collapse=0.65).thresholds[0].threshold == 0.9
    assert RuleSet.default(0.65).thresholds[0].threshold == 0.65


def test_a_rule_on_another_metric_must_give_its_threshold():
    with pytest.raises(ValueError, match=r"rules\[0\] \('low'\): threshold is required for metric 'attn_entropy'"):
        RuleSet.from_mapping({"rules": [{"name": "low", "metric": "attn_entropy", "op": "<"}]})


def test_the_rules_read_the_metric_catalogue():
    """A metric on QKAI's scale in the catalogue (qkai_max) inherits the collapse threshold too; a
    threshold outside a catalogue metric's range is refused naming it; a metric the catalogue does
    not know (one of the user's own) takes any threshold it is given, and must give one."""
    worst = RuleSet.from_mapping({"rules": [{"name": "w", "metric": "qkai_max"}]}, collapse=0.66)
    assert worst.thresholds[0].threshold == 0.66
    for metric, threshold, shown in (("qkai", 1.5, "[0.00, 1.00]"), ("attn_entropy", -0.1, "[0.00, 1.00]")):
        rule = {"name": "x", "metric": metric, "threshold": threshold}
        with pytest.raises(ValueError, match=rf"rules\[0\] \('x'\): threshold .* is outside {metric}'s range") as err:
            RuleSet.from_mapping({"rules": [rule]})
        assert shown in str(err.value)
    forecast = {"name": "f", "kind": "forecast", "metric": "qkai", "threshold": 2.0, "horizon_steps": 10}
    with pytest.raises(ValueError, match="outside qkai's range"):
        RuleSet.from_mapping({"rules": [forecast]})
    own = RuleSet.from_mapping({"rules": [{"name": "o", "metric": "my_metric", "threshold": 1e6}]})
    assert own.thresholds[0].threshold == 1e6
    with pytest.raises(ValueError, match=r"threshold is required for metric 'my_metric'.*qkai, qkai_max"):
        RuleSet.from_mapping({"rules": [{"name": "o", "metric": "my_metric"}]})


def test_an_integer_threshold_is_a_number():
    assert RuleSet.from_mapping({"rules": [{**GOOD, "threshold": 1}]}).thresholds[0].threshold == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [("", "rules: []"), ("# only a comment\n", "rules: []"), ("rules: [\n", "YAML"), ("- a\n- b\n", "mapping")],
)
def test_rules_files_that_say_nothing_or_are_not_yaml(tmp_path: Path, text: str, needle: str):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        RuleSet.from_file(path)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (
            {"rules": [{**GOOD, "kind": "trend"}]},
            "rules[0] ('r'): kind must be one of threshold, band, growth, forecast",
        ),
        ({"rules": [{k: v for k, v in GROWTH.items() if k != "factor"}]}, "rules[0] ('g'): factor is required"),
        ({"rules": [{**GROWTH, "factor": 1.0}]}, "rule 'g': factor must be above 1 (a rise) or below 1 (a fall)"),
        ({"rules": [{**GROWTH, "factor": 0}]}, "rule 'g': factor must be above 0"),
        ({"rules": [{**GROWTH, "factor": -2.0}]}, "rule 'g': factor must be above 0"),
        ({"rules": [{**GROWTH, "factor": "3"}]}, "rule 'g': factor must be a finite number"),
        ({"rules": [{**GROWTH, "factor": float("inf")}]}, "rule 'g': factor must be a finite number"),
        ({"rules": [{**GROWTH, "baseline_reports": 0}]}, "rule 'g': baseline_reports must be a whole number"),
        ({"rules": [{**GROWTH, "baseline_reports": MEMORY_MAX + 1}]}, "baseline_reports must be a whole number from 1"),
        ({"rules": [{**GROWTH, "skip_reports": -1}]}, "rule 'g': skip_reports must be a whole number >= 0"),
        ({"rules": [{**GROWTH, "op": ">"}]}, "rules[0] ('g'): unknown key 'op' for a growth rule"),
        ({"rules": [{**GROWTH, "metric": "bad metric"}]}, "rule 'g': metric"),
        ({"rules": [{k: v for k, v in FORECAST.items() if k != "horizon_steps"}]}, "('f'): horizon_steps is required"),
        ({"rules": [{**FORECAST, "horizon_steps": 0}]}, "rule 'f': horizon_steps must be a whole number >= 1"),
        ({"rules": [{**FORECAST, "horizon_steps": 2.5}]}, "rule 'f': horizon_steps must be a whole number"),
        ({"rules": [{**FORECAST, "window": 1}]}, "rule 'f': window must be a whole number from 2"),
        ({"rules": [{**FORECAST, "window": MEMORY_MAX + 1}]}, "rule 'f': window must be a whole number from 2"),
        ({"rules": [{**FORECAST, "op": "=="}]}, "rule 'f': op must be one of"),
        (
            {"rules": [{**FORECAST, "fit": "huber"}]},
            "rule 'f': fit must be one of least_squares, theil_sen, got 'huber'",
        ),
        (
            {"rules": [{**FORECAST, "fit": "theil_sen", "window": 65}]},
            "rule 'f': window (theil_sen) must be a whole number from 2 to 64",
        ),
        ({"rules": [{**FORECAST, "margin": -1}]}, "rule 'f': margin must be 0 or more, got -1"),
        ({"rules": [{**FORECAST, "margin": "1"}]}, "rule 'f': margin must be a finite number, got '1'"),
        ({"rules": [{**FORECAST, "factor": 2}]}, "rules[0] ('f'): unknown key 'factor' for a forecast rule"),
        ({"rules": [{**FORECAST, "metric": "stable_rank"}]}, "rules[0] ('f'): threshold is required for metric"),
        ({"rules": [GROWTH, {"name": "b", "band_of": "g"}]}, "rule 'b': band_of 'g' is not a threshold rule"),
        ({"rules": [GOOD, {**GROWTH, "name": "r"}]}, "rule name 'r' is used twice"),
        ({"rules": [{**GOOD, "kind": "band"}]}, "rules[0] ('r'): unknown key 'for_reports' for a band rule"),
    ],
)
def test_bad_detector_rules_are_refused_naming_the_rule_and_key(data: dict, needle: str):
    with pytest.raises(ValueError) as err:
        RuleSet.from_mapping(data)
    assert needle in str(err.value)


def test_detector_rules_parse_by_kind():
    rules = RuleSet.from_mapping({"rules": [GOOD, GROWTH, FORECAST, {**GOOD, "name": "t", "kind": "threshold"}]})
    assert [r.name for r in rules.thresholds] == ["r", "t"]
    assert rules.growths == (GrowthRule("g", factor=3.0, metric="logit_max", baseline_reports=5),)
    assert rules.forecasts == (ForecastRule("f", horizon_steps=500, threshold=COLLAPSE_THRESHOLD),)
    assert rules.metrics == {"qkai", "logit_max"}
    assert RuleSet.from_mapping({"rules": [FORECAST]}, collapse=0.65).forecasts[0].threshold == 0.65


def test_the_shipped_candidates_load_every_kind_and_keep_the_collapse_rules():
    rules = RuleSet.from_file(DETECTORS, collapse=0.65)
    default = RuleSet.default(0.65)
    assert rules.thresholds[0] == default.thresholds[0] and rules.bands == default.bands
    assert rules.forecasts and rules.growths and {r.name for r in rules.forecasts} == {"qkai_forecast"}
    assert rules.forecasts[0].threshold == 0.65  # the qkai rules follow the collapse setting
    below = {(r.metric, r.op) for r in rules.thresholds}
    assert {("stable_rank", "<"), ("attn_entropy", ">"), ("attn_entropy", "<")} <= below
    assert rules.growths[0].metric == "logit_max"
    text = DETECTORS.read_text()
    assert "NOT RECOMMENDED AS PAGES" in text and "docs/instability.md" in text  # measured, said so
    detectors = [r for r in (*rules.thresholds, *rules.growths, *rules.forecasts) if r.name != "qkai_high"]
    assert detectors and all(r.severity == "info" for r in detectors)  # recorded, never sent


def test_the_default_rules_are_the_collapse_rules_alone():
    rules = RuleSet.default()
    assert rules.thresholds == (ThresholdRule("qkai_high"),) and rules.growths == () and rules.forecasts == ()
