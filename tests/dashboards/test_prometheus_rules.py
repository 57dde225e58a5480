"""The committed Prometheus rules and config and the Alertmanager config, checked by the real tools.

promtool runs the rule unit tests of qkwatch/dashboards/prometheus/tests (input series, expected alerts
with their annotations); amtool checks the Alertmanager config and its routing tree.
"""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboards.promstack import ALERTMANAGER_YML, PROMETHEUS_YML, RULE_TESTS, RULES


def run_tool(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def alerting_rules() -> list[dict]:
    return [
        rule
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def test_rules_are_valid(promtool):
    out = run_tool(promtool, "check", "rules", *map(str, RULES))
    assert f"SUCCESS: {len(alerting_rules())} rules found" in out


def test_rule_unit_tests_pass(promtool):
    assert RULE_TESTS, "no promtool tests under qkwatch/dashboards/prometheus/tests"
    for path in RULE_TESTS:
        assert "SUCCESS" in run_tool(promtool, "test", "rules", str(path))


def test_every_rule_is_tested_firing_and_silent_and_tells_on_call_what_to_do():
    cases = [
        case
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    for rule in alerting_rules():
        name = rule["alert"]
        outcomes = {bool(case["exp_alerts"]) for case in cases if case["alertname"] == name}
        assert outcomes == {True, False}, f"{name}: needs a case where it fires and one where it does not"
        assert rule["labels"]["severity"] in ("warning", "critical", "info"), name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
        assert "Look:" in rule["annotations"]["runbook"] and "Do:" in rule["annotations"]["runbook"], name


def test_prometheus_config_is_valid_and_loads_the_rules(promtool):
    out = run_tool(promtool, "check", "config", str(PROMETHEUS_YML))
    assert f"SUCCESS: {len(RULES)} rule files found" in out


def test_alertmanager_config_is_valid(amtool):
    assert "SUCCESS" in run_tool(amtool, "check-config", str(ALERTMANAGER_YML))


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=QkwatchCollapseBand", "severity=critical"], "qkwatch-critical"),
        (["alertname=QkwatchCollectorDown", "severity=critical"], "qkwatch-critical"),
        (["alertname=QkwatchQkaiHigh", "severity=warning"], "qkwatch-warning"),
        (["alertname=SomethingElse"], "qkwatch-warning"),  # no severity: the default route
    ],
)
def test_alerts_are_routed_by_severity(amtool, labels, receiver):
    out = run_tool(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}", *labels)
    assert out.split()[0] == receiver


def test_a_band_ends_its_runs_per_layer_warnings_in_prometheus_not_by_inhibition():
    """The per-layer rule stands down while its run's band fires (in PromQL, after the band in the
    same group), and Alertmanager has no inhibit rule that could let a warning out as a band resolves."""
    rules = {r["alert"]: r for r in alerting_rules()}
    assert (
        'unless on(project, run, instance) ALERTS{alertname="QkwatchCollapseBand", alertstate="firing"}'
        in (rules["QkwatchQkaiHigh"]["expr"])
    )
    order = [r["alert"] for r in alerting_rules()]
    assert order.index("QkwatchCollapseBand") < order.index("QkwatchQkaiHigh")
    assert not yaml.safe_load(ALERTMANAGER_YML.read_text()).get("inhibit_rules")


def test_rules_use_only_metrics_the_collector_exports(collapsing_run):
    httpx.post(f"{collapsing_run.collector_url}/v1/runs/{collapsing_run.run['id']}/reports", json={})  # a rejection
    text = httpx.get(f"{collapsing_run.collector_url}/metrics").text
    families = list(text_string_to_metric_families(text))
    exported = {s.name for family in families for s in family.samples}
    # a labelled counter nothing has counted yet (5xx) is declared, with no sample: it still exists
    exported |= {f"{family.name}_total" for family in families if family.type == "counter"}
    used = {name for rule in alerting_rules() for name in re.findall(r"\bqkwatch_[a-z_]+", yaml.safe_dump(rule))}
    assert used, "no qkwatch metric found in the rules"
    assert used <= exported, f"not on /metrics: {sorted(used - exported)}"


def test_info_alerts_are_recorded_and_sent_nowhere() -> None:
    """The detectors' alerts are severity info (docs/instability.md: every candidate fired on healthy
    runs): Alertmanager routes them to a receiver without an integration, and only them."""
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    routes = {tuple(r["matchers"]): r["receiver"] for r in config["route"]["routes"]}
    receivers = {r["name"]: r for r in config["receivers"]}
    quiet = routes[('severity="info"',)]
    assert set(receivers[quiet]) == {"name"}, receivers[quiet]  # no webhook, e-mail or pager config
    info = {r["alert"] for r in alerting_rules() if r["labels"]["severity"] == "info"}
    assert info == {
        "QkwatchQkaiForecast",
        "QkwatchStableRankLow",
        "QkwatchAttentionUniform",
        "QkwatchAttentionOneHot",
        "QkwatchLogitGrowth",
    }
