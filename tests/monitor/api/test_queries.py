"""Queries: runs, heartbeat, series and heatmap downsampling, compare, export, delete, retention."""

from __future__ import annotations

import csv
import io
import json

from tests.monitor.conftest import report


def test_runs_list_filters_and_detail(h):
    a = h.create_run("alpha", config={"n_layers": 2, "lr": 3e-4})
    b = h.create_run("beta")
    h.client.patch(f"/v1/runs/{b['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    runs = h.get("/v1/runs", project=h.project)
    assert runs["count"] == 2 and {r["name"] for r in runs["data"]} == {"alpha", "beta"}
    assert [r["name"] for r in h.get("/v1/runs", project=h.project, status="finished")["data"]] == ["beta"]
    assert [r["id"] for r in h.get("/v1/runs", project=h.project, name="alpha")["data"]] == [a["id"]]
    detail = h.get(f"/v1/runs/{a['id']}")
    assert detail["config"] == {"n_layers": 2, "lr": 3e-4} and detail["status"] == "running"
    r = h.client.patch(f"/v1/runs/{a['id']}", json={"status": "paused"}, headers=h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "status"]


def test_stale_runs_are_marked_crashed_and_revive_on_reports(make_harness):
    h = make_harness(stale_timeout_s=60)
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": [0.1]})])
    last = h.get(f"/v1/runs/{run['id']}")["last_report_at"]
    h.app.state.background.run_once(now=last + 30)
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "running"
    h.app.state.background.run_once(now=last + 61)
    crashed = h.get(f"/v1/runs/{run['id']}")
    assert crashed["status"] == "crashed" and crashed["status_reason"] == "stale"
    h.send(run["id"], [report(2, {"qkai": [0.1]})])  # it was only quiet
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "running"


def test_finished_runs_stay_finished_on_late_reports(h):
    run = h.create_run()
    h.client.patch(f"/v1/runs/{run['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    h.send(run["id"], [report(9, {"qkai": [0.1]})])
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "finished"


def test_series_downsampling_keeps_min_and_max(h):
    run = h.create_run()
    values = [0.5] * 100
    values[37] = 0.99  # one spike
    values[71] = 0.01  # one dip
    h.send(run["id"], [report(s, {"qkai": [v]}) for s, v in enumerate(values)])
    s = h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, max_points=10)
    assert s["downsampled"] and len(s["steps"]) == 10
    assert max(s["max"]) == 0.99 and min(s["min"]) == 0.01
    assert s["steps"] == list(range(0, 100, 10))
    window = h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, start=30, end=40)
    assert window["steps"] == list(range(30, 41)) and window["values"][7] == 0.99


def test_heatmap_takes_the_bucket_max_by_default(h):
    run = h.create_run()
    reports = []
    for s in range(0, 1000, 10):
        band = 0.95 if s == 500 else 0.3  # a one-report collapse band in layers 2-4
        reports.append(report(s, {"qkai": [0.3, 0.3, band, band, band, 0.3]}))
    h.send(run["id"], reports)
    hm = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", max_steps=5)
    assert hm["layers"] == [0, 1, 2, 3, 4, 5] and len(hm["steps"]) == 5
    peak = [row for row in hm["values"] if max(row) > 0.9]
    assert peak == [[0.3, 0.3, 0.95, 0.95, 0.95, 0.3]]
    mean = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", max_steps=5, agg="mean")
    assert max(max(row) for row in mean["values"]) < 0.5
    full = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", max_steps=1000)
    assert full["steps"] == list(range(0, 1000, 10)) and not full["downsampled"]


def test_compare_several_runs_in_one_call(h):
    a, b = h.create_run(), h.create_run()
    h.send(a["id"], [report(s, scalars={"loss": 3.0 - s}) for s in range(3)])
    h.send(b["id"], [report(s, scalars={"loss": 4.0 - s}) for s in range(2)])
    r = h.client.get(
        "/v1/compare", params=[("run", a["id"]), ("run", b["id"]), ("metric", "loss")], headers=h.headers("read")
    )
    assert r.status_code == 200
    series = {s["run"]: s["values"] for s in r.json()["series"]}
    assert series == {a["id"]: [3.0, 2.0, 1.0], b["id"]: [4.0, 3.0]}
    r = h.client.get(
        "/v1/compare", params={"run": f"{a['id']},{'f' * 32}", "metric": "loss"}, headers=h.headers("read")
    )
    assert r.status_code == 404


def test_export_csv_and_jsonl_hold_every_point(h):
    run = h.create_run()
    h.send(
        run["id"],
        [report(s, {"qkai": [0.1, "inf"]}, heads={"qkai": [[0.2, 0.3]]}, scalars={"loss": 1.5}) for s in range(3)],
    )
    text = h.client.get(f"/v1/runs/{run['id']}/export", params={"format": "csv"}, headers=h.headers("read")).text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 3 * (2 + 2 + 1)
    assert {(r["metric"], r["layer"], r["head"], r["value"]) for r in rows if r["step"] == "1"} == {
        ("qkai", "0", "-1", "0.1"),
        ("qkai", "1", "-1", "inf"),
        ("qkai", "0", "0", "0.2"),
        ("qkai", "0", "1", "0.3"),
        ("loss", "-1", "-1", "1.5"),
    }
    lines = h.client.get(
        f"/v1/runs/{run['id']}/export", params={"format": "jsonl"}, headers=h.headers("read")
    ).text.splitlines()
    assert sorted(json.dumps(json.loads(x), sort_keys=True) for x in lines) == sorted(
        json.dumps(
            {
                "attempt": 1,
                "step": int(r["step"]),
                "metric": r["metric"],
                "layer": int(r["layer"]),
                "head": int(r["head"]),
                "value": r["value"] if r["value"] == "inf" else float(r["value"]),
            },
            sort_keys=True,
        )
        for r in rows
    )


def test_delete_removes_the_run_and_its_points(h):
    run, keep = h.create_run(), h.create_run()
    for r in (run, keep):
        h.send(r["id"], [report(1, {"qkai": [0.8]})])
    r = h.client.delete(f"/v1/runs/{run['id']}", headers=h.headers("control"))
    assert r.status_code == 204
    h.get(f"/v1/runs/{run['id']}", expect=404)
    h.get(f"/v1/runs/{run['id']}/series", expect=404, metric="qkai", layer=0)
    assert h.get(f"/v1/runs/{keep['id']}/series", metric="qkai", layer=0)["values"] == [0.8]
    again = h.create_run(run["name"])  # the name is free again: a new, empty run
    assert again["id"] != run["id"]
    h.get(f"/v1/runs/{again['id']}/series", metric="qkai", layer=0, expect=404)  # none of the old points


def test_retention_deletes_old_finished_runs_only(make_harness):
    h = make_harness(retention_days=1, stale_timeout_s=10**9)
    done, live = h.create_run(), h.create_run()
    h.client.patch(f"/v1/runs/{done['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    finished_at = h.get(f"/v1/runs/{done['id']}")["updated_at"]
    h.app.state.background.run_once(now=finished_at + 0.5 * 86400)
    h.get(f"/v1/runs/{done['id']}")
    h.app.state.background.run_once(now=finished_at + 1.5 * 86400)
    h.get(f"/v1/runs/{done['id']}", expect=404)
    h.get(f"/v1/runs/{live['id']}")


def test_metrics_list_of_a_run(h):
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": [0.1, 0.2]}, scalars={"loss": 1.0})])
    assert h.get(f"/v1/runs/{run['id']}/metrics")["metrics"] == {"loss": [-1], "qkai": [0, 1]}


def test_layers_shared_out_over_ranks_combine_in_the_heatmap(h):
    """Two reports of one step carrying different layers (two ranks) make one heatmap column."""
    run = h.create_run()
    h.send(run["id"], [report(5, {"qkai": [0.1, None, 0.3, None]})])
    h.send(run["id"], [report(5, {"qkai": [None, 0.2, None, "nan"]})])
    hm = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai")
    assert hm["steps"] == [5] and hm["values"] == [[0.1, 0.2, 0.3, "nan"]]
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=1)["values"] == [0.2]


def test_heatmap_bucket_ignores_nan_unless_all_nan(h):
    run = h.create_run()
    h.send(run["id"], [report(0, {"qkai": ["nan", "nan"]}), report(1, {"qkai": [0.4, "nan"]})])
    assert h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", max_steps=1)["values"] == [[0.4, "nan"]]
    h.get(f"/v1/runs/{run['id']}/heatmap", metric="nope", expect=404)
