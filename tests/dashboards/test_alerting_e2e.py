"""The whole alerting path with the real binaries: collector -> Prometheus -> Alertmanager -> webhook.

A live collector is fed, through its HTTP API, a run whose layer 3 and then layers 3-5 cross QKAI
0.70; the real Prometheus scrapes it every second and evaluates the committed rules (the same
expressions, labels and annotations; only their ``for`` is shortened to 2 s), and the real
Alertmanager, with the committed routes (only its timers shortened), posts to a webhook receiver of
this test. Both alerts must arrive, on the receiver of their severity; layer 3's warning resolves as
the band fires, layers 4 and 5 never page on their own, and the band resolves once a report brings
the values back down.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.dashboards.promstack import ALERTMANAGER_YML, RULES, wait_for_result

pytestmark = pytest.mark.slow


def fast_rules(workdir: Path) -> list[Path]:
    """The committed rule files with every ``for`` at 2 s (the expressions are untouched)."""
    out = []
    for path in RULES:
        groups = yaml.safe_load(path.read_text())
        for rule in (r for g in groups["groups"] for r in g["rules"] if "for" in r):
            rule["for"] = "2s"
        out.append(workdir / path.name)
        out[-1].write_text(yaml.safe_dump(groups))
    return out


def fast_alertmanager(webhook_url: str) -> dict:
    """The committed config, its webhooks pointed at the test's receiver and its timers at 1 s."""
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    config["route"].update(group_wait="1s", group_interval="1s")
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):  # qkwatch-record sends nothing
            hook["url"] = f"{webhook_url}/{receiver['name']}"
    return config


def notified(status: str, alertname: str):
    return lambda n: n["status"] == status and n["groupLabels"].get("alertname") == alertname


def layers(notification: dict, status: str = "firing") -> set[str]:
    return {a["labels"]["layer"] for a in notification["alerts"] if a["status"] == status}


def test_collapse_band_alerts_arrive_and_resolve(
    start_prometheus, start_alertmanager, webhook, collapsing_run, tmp_path
):
    run = collapsing_run
    alertmanager = start_alertmanager(fast_alertmanager(webhook.url))
    prometheus = start_prometheus([run.collector_url], fast_rules(tmp_path), alertmanagers=[alertmanager])
    wait_for_result(prometheus, 'qkwatch_qkai_ratio{run="vanilla"}')

    run.report([0.80, 0.45, 0.45])  # layer 3 alone: a warning, not yet a band
    first = webhook.wait_for(notified("firing", "QkwatchQkaiHigh"))
    assert first["receiver"] == "qkwatch-warning" and layers(first) == {"3"}
    assert first["commonLabels"]["project"] == "qkwatch-e2e" and first["commonLabels"]["run"] == "vanilla"
    assert first["alerts"][0]["annotations"]["summary"] == "QKAI 0.80 on layer 3 of run qkwatch-e2e/vanilla"

    run.report([0.86, 0.90, 0.91])  # layers 3-5: the collapse band
    band = webhook.wait_for(notified("firing", "QkwatchCollapseBand"))
    assert band["receiver"] == "qkwatch-critical"
    (alert,) = band["alerts"]
    assert run.labels.items() <= alert["labels"].items() and alert["labels"]["severity"] == "critical"
    assert "3 adjacent layers of run qkwatch-e2e/vanilla" in alert["annotations"]["summary"]
    assert "(layers 3 4 5 now)" in alert["annotations"]["description"]
    assert f"http://{run.collector_url.split('//')[1]}/?metric=qkai" in alert["annotations"]["runbook"]
    # The band has the run: layer 3's warning resolves (the rule's `unless`), and is sent as resolved.
    resolved = webhook.wait_for(notified("resolved", "QkwatchQkaiHigh"))
    assert "3" in layers(resolved, "resolved")

    run.report(0.30)  # back below the threshold everywhere
    webhook.wait_for(notified("resolved", "QkwatchCollapseBand"))
    time.sleep(5)  # a per-layer page on the way down would come within a few evaluations (1 s each)
    # 4 and 5 never paged on their own, neither as the band formed nor as it resolved.
    assert not any(
        layers(n) & {"4", "5"}
        for n in webhook.notifications
        if n["status"] == "firing" and n["groupLabels"].get("alertname") == "QkwatchQkaiHigh"
    ), webhook.summary()
