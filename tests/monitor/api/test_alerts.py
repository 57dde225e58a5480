"""Alerts through the API, and webhook delivery to a real HTTP server on loopback."""

from __future__ import annotations

import time
from pathlib import Path

from tests.monitor.conftest import report

DETECTORS = Path(__file__).resolve().parents[3] / "dashboards" / "rules" / "detectors.yml"


def qkai_reports(start: int, rows: list[list[float]]) -> list[dict]:
    return [report(start + 10 * i, {"qkai": row}) for i, row in enumerate(rows)]


def test_default_rule_fires_after_three_reports_and_resolves(h):
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.8, 0.2], [0.8, 0.2]]))
    assert h.get("/v1/alerts", run=run["id"])["count"] == 0
    h.send(run["id"], qkai_reports(20, [[0.8, 0.2]]))
    firing = h.get("/v1/alerts", run=run["id"], state="firing")["data"]
    assert [(a["rule"], a["layers"], a["onset_step"]) for a in firing] == [("qkai_high", [0], 0)]
    h.send(run["id"], qkai_reports(20, [[0.8, 0.2]]))  # a replay changes nothing
    h.send(run["id"], qkai_reports(30, [[0.5, 0.2]]))
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 0
    resolved = h.get("/v1/alerts", run=run["id"], state="resolved")["data"]
    assert [(a["layers"], a["onset_step"], a["resolved_step"]) for a in resolved] == [([0], 0, 30)]


def test_a_nan_or_interrupted_streak_does_not_fire(h):
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.8], ["nan"], [0.8], [0.8], [0.5], [0.9]]))
    assert h.get("/v1/alerts", run=run["id"])["count"] == 0


def test_band_of_three_adjacent_layers(h):
    run = h.create_run()
    two = [0.2, 0.9, 0.9, 0.2, 0.9, 0.2]
    h.send(run["id"], qkai_reports(0, [two] * 3))
    assert [a["rule"] for a in h.get("/v1/alerts", run=run["id"], state="firing")["data"]] == ["qkai_high"] * 3
    band = [0.2, 0.9, 0.9, 0.9, 0.9, 0.2]
    h.send(run["id"], qkai_reports(30, [band] * 3))
    bands = [a for a in h.get("/v1/alerts", run=run["id"], state="firing")["data"] if a["rule"] == "collapse_band"]
    assert [(a["layers"], a["onset_step"], a["severity"]) for a in bands] == [([1, 2, 3, 4], 50, "critical")]
    h.send(run["id"], qkai_reports(60, [[0.2] * 6]))
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 0
    done = [a for a in h.get("/v1/alerts", run=run["id"], state="resolved")["data"] if a["rule"] == "collapse_band"]
    assert done[0]["resolved_step"] == 60


def test_rules_file(make_harness, tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - name: low_entropy\n    metric: attn_entropy\n    op: '<'\n    threshold: 0.1\n"
        "    for_reports: 1\n    severity: page\n"
    )
    h = make_harness(alert_rules_file=rules)
    run = h.create_run()
    h.send(run["id"], [report(1, {"attn_entropy": [0.5, 0.05], "qkai": [0.99, 0.99]})] * 1)
    alerts = h.get("/v1/alerts", run=run["id"])["data"]
    assert [(a["rule"], a["layers"], a["severity"]) for a in alerts] == [("low_entropy", [1], "page")]


def test_the_end_of_a_run_closes_its_alerts_and_a_resumed_run_raises_them_afresh(h):
    """A finished (or crashed) run cannot be acted on: its alerts resolve at its last step, as
    Prometheus's do when the run leaves /metrics; the alert history keeps them, with the reason."""
    name = "ends-collapsed"
    run = h.create_run(name)
    h.send(run["id"], qkai_reports(0, [[0.9, 0.9, 0.9, 0.2]] * 3))
    assert {a["rule"] for a in h.get("/v1/alerts", run=run["id"], state="firing")["data"]} == {
        "qkai_high",
        "collapse_band",
    }
    r = h.client.patch(f"/v1/runs/{run['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    assert r.status_code == 200, r.text
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 0
    closed = h.get("/v1/alerts", run=run["id"], state="resolved")["data"]
    assert len(closed) == 4 and {a["resolved_step"] for a in closed} == {20}
    assert all(a["summary"].endswith("(closed: the run finished)") and a["ends_at"] for a in closed)

    h.create_run(name)  # the same project/name resumes it: a new attempt
    h.send(run["id"], qkai_reports(100, [[0.9, 0.2, 0.2, 0.2]] * 2))
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 0  # the streak started over
    h.send(run["id"], qkai_reports(120, [[0.9, 0.2, 0.2, 0.2]]))
    again = h.get("/v1/alerts", run=run["id"], state="firing")["data"]
    assert [(a["rule"], a["layers"], a["onset_step"]) for a in again] == [("qkai_high", [0], 100)]


def test_a_stale_run_closes_its_alerts(h):
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 1
    assert run["id"] in h.store.mark_stale(timeout_s=0.0, now=time.time() + 60)
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert alert["state"] == "resolved" and alert["summary"].endswith("(closed: the run crashed (stale))")


def test_the_candidate_detectors_forecast_with_a_predicted_step(make_harness):
    """The shipped candidates file: layer 0's QKAI rises 0.001 per step from 0.3 (crossing 0.70 at step
    400); the forecast (8 reports, 500 steps ahead, 2 reports running) fires at step 200 and says 400.
    Layer 1 stays put and raises nothing."""
    h = make_harness(alert_rules_file=DETECTORS)
    run = h.create_run()
    reports = [
        report(s, {"qkai": [0.3 + 0.001 * s, 0.3], "stable_rank": [2.0, 2.0], "attn_entropy": [0.6, 0.6]})
        for s in range(0, 226, 25)
    ]
    h.send(run["id"], reports)
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["rule"], alert["state"], alert["layers"]) == ("qkai_forecast", "firing", [0])
    assert (alert["onset_step"], alert["predicted_step"]) == (175, 400)
    assert alert["summary"] == "layer 0: qkai 0.5 rising 0.001/step, crosses 0.70 in about 200 steps (at step ~400)"
    h.send(run["id"], [report(425, {"qkai": [0.725, 0.3]})])
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["state"], alert["resolved_step"], alert["predicted_step"]) == ("resolved", 425, 400)
    assert alert["summary"] == "layer 0: qkai crossed 0.70: 0.725 at step 425 (forecast: step ~400)"
