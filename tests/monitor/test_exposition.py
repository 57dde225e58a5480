"""/metrics: run gauges of running runs only, bounded series, service counters; a fresh registry per app."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from qkwatch.monitor.exposition import widest_band
from tests.monitor.conftest import report


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    """/metrics shows every running run of its database, so each test gets a database of its own."""
    return isolated_db_url


def scrape(h) -> dict[str, list]:
    text = h.client.get("/metrics", headers=h.headers("read")).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_latest_values_of_running_runs(make_harness):
    h = make_harness()
    run = h.create_run("collapsing")
    h.send(
        run["id"],
        [
            report(
                10,
                {"qkai": [0.2, 0.8, 0.9], "attn_entropy": [0.5, 0.6, 0.7], "logit_max": [3.0, 9.5, 41.0]},
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
    assert {s.labels["layer"]: s.value for s in m["qkwatch_attn_logit_max"]} == {"0": 3.0, "1": 9.5, "2": 41.0}
    assert m["qkwatch_points_ingested"][0].value == 17  # 9 + 2 scalars + 3 + 3 late
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
                        "logit_max": [4.0] * 10,
                        "qk_cos": [0.1] * 10,
                    },
                )
                for s in range(3)
            ],
        )
    m = scrape(h)
    runs = {s.labels["run"] for s in m["qkwatch_last_step"]}
    assert len(runs) == 2
    for name in (
        "qkwatch_qkai_ratio",
        "qkwatch_stable_rank",
        "qkwatch_attn_entropy",
        "qkwatch_attn_logit_max",
        "qkwatch_lambda",
    ):
        assert len(m[name]) == 2 * 4, name  # runs x layers, not steps, not every metric reported
    run_series = sum(
        len(samples)
        for name, samples in m.items()
        if name.startswith("qkwatch_") and not name.startswith(("qkwatch_request", "qkwatch_points"))
    )
    assert run_series <= 2 * (5 * 4 + 4 + 8)  # runs x (layer gauges x layers + run gauges + agent gauges)


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


def test_server_errors_are_counted_by_route_template(make_harness, monkeypatch):
    """A 5xx (here the store failing under a route) counts once under that route; a 4xx does not."""
    h = make_harness()
    run = h.create_run()

    def broken(*args, **kwargs):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(h.store, "search_runs", broken)  # a failure below the route, as a dropped database gives
    client = TestClient(h.app, raise_server_exceptions=False)  # answer the 500 as a server would
    assert client.get("/v1/runs", headers=h.headers("read")).status_code == 500
    assert client.get("/v1/runs/nope", headers=h.headers("read")).status_code == 404
    assert client.get(f"/v1/runs/{run['id']}", headers=h.headers("read")).status_code == 200
    errors = {
        (s.labels["method"], s.labels["route"]): s.value
        for s in scrape(h)["qkwatch_http_server_errors"]
        if s.name.endswith("_total")
    }
    assert errors == {("GET", "/v1/runs"): 1.0}


def test_widest_band_counts_adjacent_layers_only():
    assert widest_band([]) == 0
    assert widest_band([4]) == 1
    assert widest_band([7, 1, 3, 5, 4]) == 3  # unsorted input; 3-5 is the band, 1 and 7 stand alone
    assert widest_band([0, 2, 4, 6]) == 1
    assert widest_band([2, 3, 3, 4]) == 3  # a layer twice is still one layer


def run_gauge(m: dict, name: str) -> dict[str, float]:
    return {s.labels["run"]: s.value for s in m[name]}


def test_collapse_band_is_the_widest_run_of_adjacent_layers_above_the_threshold(make_harness):
    h = make_harness()
    band = h.create_run("band")
    # layers 3-5 collapse, layer 0 and 7 are above the threshold alone; layer 6 is NaN (not evidence)
    h.send(band["id"], [report(10, {"qkai": [0.8, 0.2, 0.3, 0.91, 0.95, 0.75, "nan", 0.99]})])
    scattered = h.create_run("scattered")
    h.send(scattered["id"], [report(10, {"qkai": [0.9, 0.1, 0.9, 0.1, 0.9, 0.1]})])
    at_threshold = h.create_run("at-threshold")  # "exceeds" is strict, as in qkai_high's ">"
    h.send(at_threshold["id"], [report(10, {"qkai": [0.7, 0.7, 0.7]})])
    h.create_run("no-qkai-yet")  # running without a report: exported as 0, not absent
    m = scrape(h)
    assert run_gauge(m, "qkwatch_collapse_band_layers") == {
        "band": 3,
        "scattered": 1,
        "at-threshold": 0,
        "no-qkai-yet": 0,
    }
    assert run_gauge(m, "qkwatch_collapsed_layers") == {"band": 5, "scattered": 3, "at-threshold": 0, "no-qkai-yet": 0}


def test_collapse_band_follows_the_latest_report_and_the_threshold_setting(make_harness):
    h = make_harness(collapse_threshold=0.5)
    run = h.create_run("recovering")
    h.send(run["id"], [report(10, {"qkai": [0.3, 0.6, 0.6, 0.6, 0.6, 0.3]})])
    assert run_gauge(scrape(h), "qkwatch_collapse_band_layers") == {"recovering": 4}
    h.send(run["id"], [report(20, {"qkai": [0.3, 0.6, 0.4, 0.6, 0.6, 0.3]})])
    assert run_gauge(scrape(h), "qkwatch_collapse_band_layers") == {"recovering": 2}


def test_agent_delivery_counters_are_exported_per_run(make_harness):
    h = make_harness()
    run = h.create_run("lossy")
    h.send(run["id"], [report(10, scalars={"agent_dropped_total": 2, "agent_dead_lettered_total": 5})])
    m = scrape(h)
    for name, value in (("qkwatch_agent_dropped", 2), ("qkwatch_agent_dead_lettered", 5)):
        assert [(s.name, s.labels, s.value) for s in m[name]] == [
            (f"{name}_total", {"project": h.project, "run": "lossy", "rank": "0"}, value)
        ]


def test_each_ranks_agent_health_is_exported_with_its_rank(make_harness):
    """Under FSDP every rank's agent reports its own counters, suffixed ``_rank<r>``: one series each."""
    h = make_harness()
    run = h.create_run("sharded")
    h.send(
        run["id"],
        [
            report(
                10,
                scalars={
                    "agent_dropped_total_rank0": 1,
                    "agent_dropped_total_rank1": 7,
                    "agent_spool_bytes_rank1": 4096,
                    "agent_ranked_rank2": 3,
                    "loss_rank1": 2.0,
                },
            )
        ],
    )
    m = scrape(h)
    dropped = {s.labels["rank"]: s.value for s in m["qkwatch_agent_dropped"] if s.name.endswith("_total")}
    assert dropped == {"0": 1, "1": 7}
    assert [(s.labels, s.value) for s in m["qkwatch_agent_spool_bytes"]] == [
        ({"project": h.project, "run": "sharded", "rank": "1"}, 4096)
    ]
    assert m["qkwatch_train_loss"] == []  # only the agent's own series carry ranks
    assert not any("ranked" in name for name in m)
