"""The rules file is validated completely, every field by type, and an empty one is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkwatch.monitor.alerting.rules import RuleSet

GOOD = {"name": "r", "metric": "qkai", "op": ">", "threshold": 0.7, "for_reports": 2, "severity": "warning"}


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
