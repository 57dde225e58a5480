"""Alerts through the API, and webhook delivery to a real HTTP server on loopback."""

from __future__ import annotations

import time
from pathlib import Path

from tests.monitor.conftest import report

DETECTORS = Path(__file__).resolve().parents[3] / "qkwatch" / "dashboards" / "rules" / "detectors.yml"


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


def patch(h, run_id: str, **body) -> dict:
    r = h.client.patch(f"/v1/runs/{run_id}", json=body, headers=h.headers("ingest"))
    assert r.status_code == 200, r.text
    return r.json()


def by_layers(alerts: list[dict]) -> dict[tuple[str, tuple[int, ...]], dict]:
    return {(a["rule"], tuple(a["layers"])): a for a in alerts}


def test_the_end_of_a_run_keeps_its_firing_alerts_as_ended_with_their_last_values(h):
    """Finished while layers 0-2 still collapse: nothing resolved their alerts, so none reads as resolved;
    each is "ended" with the run's last step, how it ended and the layers' last QKAI."""
    run = h.create_run("ends-collapsed")
    h.send(run["id"], qkai_reports(0, [[0.9, 0.9, 0.9, 0.2]] * 3 + [[0.93, 0.91, "inf", 0.2]]))
    h.send(run["id"], [report(35, {}, scalars={"loss": 2.5})])  # the run's last step: a loss only
    firing = h.get("/v1/alerts", run=run["id"], state="firing")["data"]
    assert {a["rule"] for a in firing} == {"qkai_high", "collapse_band"} and len(firing) == 4
    summaries = {a["id"]: a["summary"] for a in firing}

    assert patch(h, run["id"], status="finished")["status"] == "finished"
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 0
    assert h.get("/v1/alerts", run=run["id"], state="resolved")["count"] == 0
    ended = h.get("/v1/alerts", run=run["id"], state="ended")["data"]
    assert sorted(a["id"] for a in ended) == sorted(summaries)  # the same alerts, not new ones
    assert h.get("/v1/alerts", run=run["id"])["count"] == 4
    for a in ended:
        assert (a["state"], a["ended_step"], a["run_end"], a["resolved_step"]) == ("ended", 35, "finished", None)
        assert a["summary"] == summaries[a["id"]] and a["ends_at"] and a["ends_at_iso"]
    last = {key: a["last_values"] for key, a in by_layers(ended).items()}
    assert last == {
        ("qkai_high", (0,)): [0.93],
        ("qkai_high", (1,)): [0.91],
        ("qkai_high", (2,)): ["inf"],
        ("collapse_band", (0, 1, 2)): [0.93, 0.91, "inf"],
    }
    assert h.get("/v1/alerts", expect=422, run=run["id"], state="over")["detail"][0]["loc"] == ["query", "state"]


def test_a_resumed_attempt_carries_its_ended_alerts_on_or_resolves_them(h):
    """Attempt 2 resumes the finished run: layer 0 still collapses, so its alert (the same one) fires
    again; layers 1 and 2 have healed, so theirs resolve at attempt 2's first report, and the band with them."""
    name = "ends-then-resumes"
    run = h.create_run(name, attempt_key="first")
    h.send(run["id"], qkai_reports(0, [[0.9, 0.9, 0.9, 0.2]] * 3))
    patch(h, run["id"], status="finished")
    ended = by_layers(h.get("/v1/alerts", run=run["id"], state="ended")["data"])
    assert len(ended) == 4

    assert h.create_run(name, attempt_key="second")["attempt"] == 2
    h.send(run["id"], qkai_reports(100, [[0.94, 0.2, 0.2, 0.2]]), attempt=2)
    now = by_layers(h.get("/v1/alerts", run=run["id"])["data"])
    assert set(now) == set(ended) and {k: a["id"] for k, a in now.items()} == {k: a["id"] for k, a in ended.items()}
    again = now[("qkai_high", (0,))]
    assert (again["state"], again["onset_step"], again["ends_at"], again["ended_step"]) == ("firing", 0, None, None)
    assert (again["run_end"], again["last_values"]) == (None, None)
    for key in (("qkai_high", (1,)), ("qkai_high", (2,)), ("collapse_band", (0, 1, 2))):
        assert (now[key]["state"], now[key]["resolved_step"], now[key]["run_end"]) == ("resolved", 100, None)


def test_a_stale_run_ends_its_alerts_and_its_next_report_reopens_them(h):
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))
    assert h.get("/v1/alerts", run=run["id"], state="firing")["count"] == 1
    assert run["id"] in h.store.mark_stale(timeout_s=0.0, now=time.time() + 60)
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["state"], alert["run_end"], alert["ended_step"], alert["last_values"]) == (
        "ended",
        "stale",
        20,
        [0.9],
    )

    h.send(run["id"], qkai_reports(30, [[0.92]]))  # it was only silent: it reports on, still collapsed
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "running"
    (again,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (again["id"], again["state"], again["run_end"]) == (alert["id"], "firing", None)


def test_the_agents_own_end_after_a_stale_mark_says_how_the_run_ended(h):
    run = h.create_run()
    h.send(run["id"], qkai_reports(0, [[0.9]] * 3))
    h.store.mark_stale(timeout_s=0.0, now=time.time() + 60)
    patch(h, run["id"], status="finished")
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["state"], alert["run_end"], alert["ended_step"]) == ("ended", "finished", 20)


def test_the_candidate_detectors_forecast_with_a_predicted_step(make_harness):
    """The shipped candidates file: layer 0's QKAI rises 0.001 per step from 0.3 (crossing 0.70 at step
    400), reported every 10 steps from step 5; the forecast (a Theil-Sen line through 24 reports, 100
    steps ahead) fires at step 305, the first report within 100 steps of 400, and says 400. Layer 1
    stays put and raises nothing."""
    h = make_harness(alert_rules_file=DETECTORS)
    run = h.create_run()
    reports = [
        report(s, {"qkai": [0.3 + 0.001 * s, 0.3], "stable_rank": [2.0, 2.0], "attn_entropy": [0.6, 0.6]})
        for s in range(5, 306, 10)
    ]
    h.send(run["id"], reports)
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["rule"], alert["state"], alert["layers"]) == ("qkai_forecast", "firing", [0])
    assert (alert["onset_step"], alert["predicted_step"]) == (305, 400)
    assert alert["summary"] == "layer 0: qkai 0.605 rising 0.001/step, crosses 0.70 in about 95 steps (at step ~400)"
    h.send(run["id"], [report(425, {"qkai": [0.725, 0.3]})])
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert (alert["state"], alert["resolved_step"], alert["predicted_step"]) == ("resolved", 425, 400)
    assert alert["summary"] == "layer 0: qkai crossed 0.70: 0.725 at step 425 (forecast: step ~400)"
