"""/metrics: run gauges of running runs only, bounded series, service counters; a fresh registry per app."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.monitor.conftest import report


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    """/metrics shows every running run of its database, so each test gets a database of its own."""
    return isolated_db_url


def scrape(h) -> dict[str, list]:
    text = h.client.get("/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_latest_values_of_running_runs(make_harness):
    h = make_harness()
    run = h.create_run("collapsing")
    h.send(
        run["id"],
        [
            report(
                10,
                {"qkai": [0.2, 0.8, 0.9], "attn_entropy": [0.5, 0.6, 0.7]},
                scalars={"agent_queue_depth": 3, "agent_sent_total": 40},
            ),
            report(20, {"qkai": [0.3, 0.85, 0.95]}),
        ],
    )
    h.send(run["id"], [report(5, {"qkai": [0.0, 0.0, 0.0]})])  # late: must not replace the latest
    m = scrape(h)
    qkai = {s.labels["layer"]: s.value for s in m["qkwatch_qkai_ratio"]}
    assert qkai == {"0": 0.3, "1": 0.85, "2": 0.95}
    assert all(s.labels["run"] == "collapsing" and s.labels["project"] == h.project for s in m["qkwatch_qkai_ratio"])
    assert [s.value for s in m["qkwatch_collapsed_layers"]] == [2]
    assert [s.value for s in m["qkwatch_last_step"]] == [20]
    assert m["qkwatch_last_report_timestamp_seconds"][0].value > 0
    assert [s.value for s in m["qkwatch_agent_queue_depth"]] == [3]
    assert [s.value for s in m["qkwatch_agent_sent"] if s.name.endswith("_total")] == [40]
    assert m["qkwatch_points_ingested"][0].value == 14  # 6 + 2 scalars + 3 + 3 late
    assert not any("step" in s.labels for samples in m.values() for s in samples)


def test_finished_runs_drop_out(make_harness):
    h = make_harness()
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": [0.5]})])
    assert len(scrape(h)["qkwatch_qkai_ratio"]) == 1
    h.client.patch(f"/v1/runs/{run['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    m = scrape(h)
    assert m["qkwatch_qkai_ratio"] == [] and m["qkwatch_last_step"] == []


def test_series_count_is_bounded(make_harness):
    h = make_harness(metrics_max_runs=2, metrics_max_layers=4)
    for _ in range(5):
        run = h.create_run()
        h.send(
            run["id"],
            [
                report(
                    s,
                    {
                        "qkai": [0.5] * 10,
                        "stable_rank": [3.0] * 10,
                        "attn_entropy": [0.7] * 10,
                        "lambda": [0.1] * 10,
                        "qk_cos": [0.1] * 10,
                    },
                )
                for s in range(3)
            ],
        )
    m = scrape(h)
    runs = {s.labels["run"] for s in m["qkwatch_last_step"]}
    assert len(runs) == 2
    for name in ("qkwatch_qkai_ratio", "qkwatch_stable_rank", "qkwatch_attn_entropy", "qkwatch_lambda"):
        assert len(m[name]) == 2 * 4, name  # runs x layers, not steps, not every metric reported
    run_series = sum(
        len(samples)
        for name, samples in m.items()
        if name.startswith("qkwatch_") and not name.startswith(("qkwatch_request", "qkwatch_points"))
    )
    assert run_series <= 2 * (4 * 4 + 3 + 7)  # runs x (layer gauges x layers + run gauges + agent gauges)


def test_request_durations_are_labelled_by_route_template(make_harness):
    h = make_harness()
    run = h.create_run()
    h.get(f"/v1/runs/{run['id']}")
    routes = {s.labels["route"] for s in scrape(h)["qkwatch_request_duration_seconds"]}
    assert "/v1/runs/{run_id}" in routes and not any(run["id"] in r for r in routes)


def test_rejections_are_counted_by_reason(make_harness):
    h = make_harness()
    run = h.create_run()
    h.client.post(f"/v1/runs/{run['id']}/reports", json={"reports": []}, headers=h.headers("ingest"))
    h.client.post(f"/v1/runs/{run['id']}/reports", json={})
    rejected = {
        s.labels["reason"]: s.value for s in scrape(h)["qkwatch_requests_rejected"] if s.name.endswith("_total")
    }
    assert rejected == {"invalid": 1, "unauthenticated": 1}
