"""Ingest: exactly once, attempts, non-finite values, limits and errors, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import uuid

import pytest

from qkwatch.contract.scheduling import ScheduleConfig
from tests.monitor.conftest import report


def test_batch_is_stored_once_and_counts_points(h):
    run = h.create_run()
    reports = [report(s, {"qkai": [0.1, 0.2, None]}, scalars={"loss": 2.5, "lr": None}) for s in (0, 10)]
    first = h.send(run["id"], reports, batch_id="5b1e8a52-6d1c-4b7e-9a8e-2f0f6f0c1a11")
    assert first == {"inserted": 6, "duplicates": 0}  # 2 reports x (2 layer values + 1 scalar); nulls not stored
    again = h.send(run["id"], reports, batch_id="5b1e8a52-6d1c-4b7e-9a8e-2f0f6f0c1a11")
    assert again == {"inserted": 0, "duplicates": 6}
    other_id = h.send(run["id"], reports)  # a new batch id with the same points: natural key dedupes
    assert other_id == {"inserted": 0, "duplicates": 6}
    s = h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=1)
    assert s["steps"] == [0, 10] and s["values"] == [0.2, 0.2]
    assert h.get(f"/v1/runs/{run['id']}/series", metric="loss")["values"] == [2.5, 2.5]


def test_partial_overlap_and_out_of_order_batches(h):
    run = h.create_run()
    h.send(run["id"], [report(20, {"qkai": [0.5]})])
    result = h.send(run["id"], [report(s, {"qkai": [0.5]}) for s in (0, 10, 20)])  # late + one duplicate
    assert result == {"inserted": 2, "duplicates": 1}
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0)["steps"] == [0, 10, 20]
    assert h.get(f"/v1/runs/{run['id']}")["last_step"] == 20


def test_non_finite_values_round_trip(h):
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": ["nan", "inf", "-inf", 1e308, 0.0]}, scalars={"loss": "nan"})])
    s = [h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=i)["values"][0] for i in range(5)]
    assert s == ["nan", "inf", "-inf", 1e308, 0.0]
    assert h.get(f"/v1/runs/{run['id']}/series", metric="loss")["values"] == ["nan"]
    hm = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai")
    assert hm["values"] == [["nan", "inf", "-inf", 1e308, 0.0]]
    lines = h.client.get(
        f"/v1/runs/{run['id']}/export", params={"format": "jsonl"}, headers=h.headers("read")
    ).text.splitlines()
    values = {(d["metric"], d["layer"]): d["value"] for d in map(json.loads, lines)}
    assert values[("qkai", 0)] == "nan" and values[("qkai", 2)] == "-inf" and values[("loss", -1)] == "nan"


def test_per_head_values_are_stored_apart_from_layer_values(h):
    run = h.create_run()
    h.send(run["id"], [report(5, {"qkai": [0.4, 0.6]}, heads={"qkai": [[0.3, 0.5], None]})])
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0)["values"] == [0.4]
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, head=1)["values"] == [0.5]
    assert h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", head=0)["values"] == [[0.3]]


def test_bare_nan_is_refused_naming_the_field_and_nothing_is_stored(h):
    run = h.create_run()
    raw = (
        '{"batch_id": "BATCH", "reports": [{"step": 1, "time": 1, "layers": {"qkai": [0.1, 0.2]}},'
        '{"step": 2, "time": 2, "layers": {"qkai": [0.1, NaN]}}]}'
    ).replace("BATCH", str(uuid.uuid4()))
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        content=raw,
        headers={**h.headers("ingest"), "content-type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "reports", 1, "layers", "qkai", 1]
    assert "nan" in r.json()["detail"][0]["msg"]
    h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, expect=404)  # nothing was stored


def test_wrong_type_and_missing_field_name_the_field(h):
    run = h.create_run()
    url = f"/v1/runs/{run['id']}/reports"
    bad_value = {"batch_id": str(uuid.uuid4()), "reports": [report(1, {"qkai": ["high"]})]}
    r = h.client.post(url, json=bad_value, headers=h.headers("ingest"))
    assert r.status_code == 422 and any(
        d["loc"][:5] == ["body", "reports", 0, "layers", "qkai"] for d in r.json()["detail"]
    )
    missing = {"batch_id": str(uuid.uuid4()), "reports": [{"step": 1}]}
    r = h.client.post(url, json=missing, headers=h.headers("ingest"))
    assert r.status_code == 422 and ["body", "reports", 0, "time"] in [d["loc"] for d in r.json()["detail"]]
    r = h.client.post(url, json={"batch_id": "not-a-uuid", "reports": [report(1)]}, headers=h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "batch_id"]
    r = h.client.post(url, json={"batch_id": str(uuid.uuid4()), "reports": [report(-1)]}, headers=h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reports", 0, "step"]


def test_unknown_run_is_404(h):
    h.send("0" * 32, [report(1, {"qkai": [0.1]})], expect=404)


def test_body_over_the_limit_is_413_before_reading(make_harness):
    h = make_harness(max_body_bytes=2048)
    run = h.create_run()
    big = {"batch_id": str(uuid.uuid4()), "reports": [report(s, {"qkai": [0.5] * 50}) for s in range(20)]}
    r = h.client.post(f"/v1/runs/{run['id']}/reports", json=big, headers=h.headers("ingest"))
    assert r.status_code == 413 and "2048" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it streams
        yield b'{"batch_id": "%s", "reports": [' % str(uuid.uuid4()).encode()
        for _ in range(100):
            yield b'{"step": 1, "time": 1, "layers": {"qkai": [0.5, 0.5, 0.5]}},'
        yield b'{"step": 1, "time": 1}]}'

    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        content=chunks(),
        headers={**h.headers("ingest"), "content-type": "application/json"},
    )
    assert r.status_code == 413
    h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, expect=404)  # nothing was stored


def test_too_many_points_is_413(make_harness):
    h = make_harness(max_points_per_batch=10)
    run = h.create_run()
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        headers=h.headers("ingest"),
        json={"batch_id": str(uuid.uuid4()), "reports": [report(1, {"qkai": [0.1] * 11})]},
    )
    assert r.status_code == 413 and "11 points" in r.json()["detail"]
    h.send(run["id"], [report(1, {"qkai": [0.1] * 10})])


def test_more_metric_names_than_a_run_may_have_is_422_naming_the_limit(make_harness):
    """QKWATCH_MAX_METRIC_NAMES_PER_RUN: a batch that would give the run more distinct metric names is
    refused whole (422 naming the limit, its value and the new names); what the run has stays."""
    h = make_harness(max_metric_names_per_run=3)
    run = h.create_run()
    h.send(run["id"], [report(0, {"qkai": [0.5, 0.6]}, scalars={"loss": 2.0})])
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        headers=h.headers("ingest"),
        json={"batch_id": str(uuid.uuid4()), "reports": [report(1, {"qkai": [0.4, 0.5]}, scalars={"a": 1, "b": 2})]},
    )
    detail = r.json()["detail"]
    assert r.status_code == 422
    assert "the limit is 3 names per run" in detail and "QKWATCH_MAX_METRIC_NAMES_PER_RUN" in detail
    assert "adds 2 (a, b)" in detail
    assert h.get(f"/v1/runs/{run['id']}/metrics")["metrics"] == {"loss": [-1], "qkai": [0, 1]}
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0)["steps"] == [0]
    assert h.send(run["id"], [report(1, {"qkai": [0.4, 0.5]}, scalars={"a": 1})])["inserted"] == 3


def test_events_are_stored_once_per_step_and_kind(h):
    run = h.create_run()
    ev = {"kind": "missing_layers", "message": "layers 3, 4 not measured", "data": {"layers": [3, 4]}}
    h.send(run["id"], [report(7, events=[ev])])
    h.send(run["id"], [report(7, events=[ev])])
    events = h.get(f"/v1/runs/{run['id']}/events")
    assert events["count"] == 1
    assert events["data"][0] | {"time": 0, "time_iso": ""} == {
        "attempt": 1,
        "step": 7,
        "kind": "missing_layers",
        "message": ev["message"],
        "data": {"layers": [3, 4]},
        "time": 0,
        "time_iso": "",
    }


def test_attempts_keep_relogged_steps_and_merge_latest_wins(h):
    run = h.create_run(attempt_key="a1")
    assert run["attempt"] == 1
    h.send(run["id"], [report(s, {"qkai": [0.1 * (s // 10 + 1)]}) for s in (0, 10, 20, 30)])
    resumed = h.create_run(run["name"], attempt_key="a2")  # resumed from the checkpoint at step 10
    assert resumed["id"] == run["id"] and resumed["attempt"] == 2
    assert h.create_run(run["name"], attempt_key="a2")["attempt"] == 2  # idempotent
    assert h.create_run(run["name"], attempt_key="a1")["attempt"] == 1
    assert h.create_run(run["name"])["attempt"] == 2  # no key: the latest
    r = h.send(run["id"], [report(s, {"qkai": [0.9]}) for s in (20, 30, 40)])  # default: latest attempt
    assert r == {"inserted": 3, "duplicates": 0}  # the same steps again, kept as attempt 2
    merged = h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0)
    assert merged["steps"] == [0, 10, 20, 30, 40]
    assert merged["values"] == [0.1, 0.2, 0.9, 0.9, 0.9]
    first = h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, attempt=1)
    assert first["values"] == [0.1, 0.2, 0.30000000000000004, 0.4]
    assert h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai")["values"] == [[0.1], [0.2], [0.9], [0.9], [0.9]]
    # an offline agent's late batch for attempt 1 is still accepted, and does not win the merge
    assert h.send(run["id"], [report(50, {"qkai": [0.3]})], attempt=1) == {"inserted": 1, "duplicates": 0}
    h.send(run["id"], [report(60, {"qkai": [0.3]})], attempt=3, expect=422)
    csv_lines = h.client.get(f"/v1/runs/{run['id']}/export", headers=h.headers("read")).text.splitlines()
    assert csv_lines[0] == "attempt,step,metric,layer,head,value"
    assert len(csv_lines) == 1 + 6  # merged: steps 0..50, one row each


def test_recreating_a_finished_run_sets_it_running(h):
    run = h.create_run()
    r = h.client.patch(f"/v1/runs/{run['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    assert r.json()["status"] == "finished"
    again = h.create_run(run["name"], config={"n_layers": 2})
    assert again["status"] == "running" and again["config"] == {"n_layers": 2}


BAD_SCHEDULES = [
    ({"beta": 0}, "config.schedule.beta"),
    ({"beta": -1}, "config.schedule.beta"),
    ({"ema": 1}, "config.schedule.ema"),
    ({"ema": -0.5}, "config.schedule.ema"),
    ({"h_star": "0.8"}, "config.schedule.h_star"),
    ({"beta": True}, "config.schedule.beta"),
    ({"lambda_0": 10**400}, "config.schedule.lambda_0"),
    ({"lambda_max": -1}, "config.schedule.lambda_max"),
    ({"gamma": 0.1}, "config.schedule.gamma"),
    ("fast", "config.schedule must be an object"),
]


@pytest.mark.parametrize(("schedule", "named"), BAD_SCHEDULES)
def test_invalid_schedule_in_config_is_422_naming_the_key(h, schedule, named):
    r = h.client.post(
        "/v1/runs",
        headers=h.headers("ingest"),
        json={"project": h.project, "name": "x", "config": {"schedule": schedule}},
    )
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "config", "schedule"] and named in error["msg"], r.text
    assert h.get("/v1/runs", project=h.project)["count"] == 0


@pytest.mark.parametrize(
    "config", [{"schedule": {"beta": 0}, "lr": 1.0}, {"schedule": {"ema": 10**400}}, {"n_layers": True}]
)
def test_a_refused_config_changes_nothing_already_stored(h, config):
    good = {"n_layers": 2, "schedule": {"lambda_max": 1.0}, "lr": 3e-4}
    run = h.create_run("kept", config=good, attempt_key="a1")
    h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"1": 0.5}, headers=h.headers("control"))
    h.send(run["id"], [report(1, {"attn_entropy": [0.9, 0.9]})])
    before = (h.get(f"/v1/runs/{run['id']}"), h.get(f"/v1/runs/{run['id']}/lambdas"))
    body = {"project": h.project, "name": "kept", "config": config, "attempt_key": "a2"}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == 422, r.text
    assert (h.get(f"/v1/runs/{run['id']}"), h.get(f"/v1/runs/{run['id']}/lambdas")) == before
    assert before[0]["config"]["lr"] == 3e-4 and before[1]["overrides"] == {"1": 0.5}
    assert before[0]["latest_attempt"] == 1 and len(h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]) == 1


def test_other_config_keys_are_stored_and_served_as_sent(h):
    """Users put hyperparameters there: any key, any JSON value (a huge integer too), kept as it is."""
    free = {"lr": 3e-4, "recipe": {"name": "c", "tags": ["a", None, 2]}, "seed": 10**400, "copy": "x", "_raw": True}
    run = h.create_run(config={"n_layers": 2, **free})
    assert run["config"] == {"n_layers": 2, **free}
    assert h.get(f"/v1/runs/{run['id']}")["config"] == {"n_layers": 2, **free}
    assert h.get("/v1/runs", project=h.project)["data"][0]["config"] == {"n_layers": 2, **free}


def test_a_given_schedule_is_stored_with_every_parameter(h):
    """What the run ran with stays on its record, ``lambda_max`` resolved from ``lambda_0``."""
    run = h.create_run(config={"schedule": {"lambda_0": 1e-3, "beta": 0.1}})
    expected = {"lambda_0": 1e-3, "h_star": ScheduleConfig().h_star, "beta": 0.1, "ema": 0.8, "lambda_max": 0.1}
    assert run["config"]["schedule"] == {**expected, "floor": 0.1}
    assert h.get(f"/v1/runs/{run['id']}/lambdas")["schedule"] == run["config"]["schedule"]


def test_responses_are_strict_json(h):
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": ["nan", "inf"]})])
    bare = []
    for path, params in (
        (f"/v1/runs/{run['id']}/series", {"metric": "qkai", "layer": 0}),
        (f"/v1/runs/{run['id']}/heatmap", {"metric": "qkai"}),
        (f"/v1/runs/{run['id']}/lambdas", {}),
        ("/v1/runs", {}),
    ):
        text = h.client.get(path, params=params, headers=h.headers("read")).text
        json.loads(text, parse_constant=bare.append)
    assert bare == []
