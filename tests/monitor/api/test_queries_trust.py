"""Queries a user can trust, on both databases: a question the run cannot answer is a 4xx naming the
problem, never an empty 200; runs by ``project/name``; ISO 8601 times; runs found by what happened
in them; a whole run's history in one call."""

from __future__ import annotations

import base64
import json
import math
import struct
import uuid
from array import array
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkwatch.monitor.api import queries
from tests.monitor.conftest import report

N_LAYERS = 4


def four_layer_run(h, name: str | None = None, steps: range = range(0, 50, 10)) -> dict:
    run = h.create_run(name, config={"n_layers": N_LAYERS})
    h.send(
        run["id"],
        [
            report(
                s,
                {"qkai": [0.1, 0.2, 0.3, 0.4], "stable_rank": [5.0, "nan", 3.0, "inf"]},
                scalars={"loss": 3.0 - s / 100},
            )
            for s in steps
        ],
    )
    return run


def detail(h, path: str, expect: int, **params) -> str:
    r = h.client.get(path, params=params, headers=h.headers("read"))
    assert r.status_code == expect, r.text
    return r.json()["detail"]


# ---- a query that cannot be answered says so -------------------------------------------------------


def test_per_layer_metric_without_a_layer_is_422_naming_it(h):
    run = four_layer_run(h)
    msg = detail(h, f"/v1/runs/{run['id']}/series", 422, metric="qkai")
    assert "'qkai'" in msg and "per layer" in msg and "layers 0-3" in msg and "layer=" in msg


def test_unknown_metric_is_404_naming_it_and_what_the_run_has(h):
    run = four_layer_run(h)
    msg = detail(h, f"/v1/runs/{run['id']}/series", 404, metric="qkia", layer=0)
    assert "'qkia'" in msg and "qkai" in msg and "loss" in msg
    assert "'qkia'" in detail(h, f"/v1/runs/{run['id']}/heatmap", 404, metric="qkia")
    empty = h.create_run()
    assert "none yet" in detail(h, f"/v1/runs/{empty['id']}/heatmap", 404, metric="qkai")


def test_a_layer_the_run_does_not_have_is_404_naming_it(h):
    run = four_layer_run(h)
    msg = detail(h, f"/v1/runs/{run['id']}/series", 404, metric="qkai", layer=99)
    assert "layer 99" in msg and "'qkai'" in msg and "layers 0-3" in msg


def test_run_level_scalars_still_work_and_take_no_layer(h):
    run = four_layer_run(h)
    s = h.get(f"/v1/runs/{run['id']}/series", metric="loss")
    assert s["layer"] == -1 and s["steps"] == [0, 10, 20, 30, 40] and s["values"][0] == 3.0
    assert h.get(f"/v1/runs/{run['id']}/series", metric="loss", layer=-1)["values"] == s["values"]
    assert "scalar" in detail(h, f"/v1/runs/{run['id']}/series", 422, metric="loss", layer=2)
    assert "scalar" in detail(h, f"/v1/runs/{run['id']}/heatmap", 422, metric="loss")


def test_a_head_or_an_attempt_the_run_does_not_have_is_404(h):
    run = h.create_run()
    h.send(run["id"], [report(1, {"qkai": [0.4]}, heads={"qkai": [[0.5, 0.6]]})])
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, head=1)["values"] == [0.6]
    assert "head 7" in detail(h, f"/v1/runs/{run['id']}/series", 404, metric="qkai", layer=0, head=7)
    assert "head 7" in detail(h, f"/v1/runs/{run['id']}/heatmap", 404, metric="qkai", head=7)
    for path, params in (
        ("series", {"metric": "qkai", "layer": 0}),
        ("heatmap", {"metric": "qkai"}),
        ("history", {}),
        ("events", {}),
        ("export", {}),
    ):
        msg = detail(h, f"/v1/runs/{run['id']}/{path}", 404, attempt=3, **params)
        assert "no attempt 3" in msg and "latest is 1" in msg, path


def test_an_empty_step_range_is_a_good_question_with_an_empty_answer(h):
    run = four_layer_run(h)
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=1, start=1000)["steps"] == []
    assert h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", start=1000)["steps"] == []


def test_compare_names_the_run_that_lacks_the_metric(h):
    a = four_layer_run(h, "has-loss")
    b = h.create_run("no-loss")
    h.send(b["id"], [report(0, {"qkai": [0.5]})])
    r = h.client.get(
        "/v1/compare", params=[("run", a["id"]), ("run", b["id"]), ("metric", "loss")], headers=h.headers("read")
    )
    assert r.status_code == 404 and "no-loss" in r.json()["detail"] and "'loss'" in r.json()["detail"]


# ---- a run by project/name -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "with%percent", "λ-run", "a:b?c#d"])
def test_every_run_path_takes_project_slash_name(h, name):
    run = four_layer_run(h, name)
    ref = quote(f"{h.project}/{name}", safe="")  # the slash travels as %2F
    assert h.get(f"/v1/runs/{ref}")["id"] == run["id"]
    assert h.get(f"/v1/runs/{ref}/series", metric="qkai", layer=2)["values"] == [0.3] * 5
    assert h.get(f"/v1/runs/{ref}/heatmap", metric="qkai")["layers"] == [0, 1, 2, 3]
    assert h.get(f"/v1/runs/{ref}/history", metrics="loss")["run"] == run["id"]
    assert h.get(f"/v1/runs/{ref}/metrics")["metrics"]["qkai"] == [0, 1, 2, 3]
    assert h.get(f"/v1/runs/{ref}/events")["count"] == 0
    if name.isascii():  # the export's file name of a non-Latin-1 name is another test's (Content-Disposition)
        export = h.client.get(f"/v1/runs/{ref}/export", headers=h.headers("read"))
        assert export.status_code == 200 and len(export.text.splitlines()) == 1 + 5 * (4 + 4 + 1)
    assert h.get(f"/v1/runs/{ref}/lambdas")["version"] >= 0
    r = h.client.put(f"/v1/runs/{ref}/lambdas/overrides", json={"1": 0.0}, headers=h.headers("control"))
    assert r.status_code == 200 and r.json()["overrides"] == {"1": 0.0}
    assert h.get(f"/v1/runs/{ref}/lambdas/audit")["count"] == 1
    batch = {"batch_id": str(uuid.uuid4()), "reports": [{"step": 99, "time": 1.0, "scalars": {"loss": 1.0}}]}
    sent = h.client.post(f"/v1/runs/{ref}/reports", json=batch, headers=h.headers("ingest"))
    assert sent.status_code == 200 and sent.json()["inserted"] == 1
    plain = f"{h.project}/{name}"  # query parameters take it as it is
    assert h.get("/v1/alerts", run=plain)["count"] == 0
    compared = h.client.get("/v1/compare", params={"run": plain, "metric": "loss"}, headers=h.headers("read"))
    assert compared.json()["series"][0]["run"] == run["id"]
    r = h.client.patch(f"/v1/runs/{ref}", json={"status": "finished"}, headers=h.headers("ingest"))
    assert r.status_code == 200 and r.json()["status"] == "finished"
    assert h.client.delete(f"/v1/runs/{ref}", headers=h.headers("control")).status_code == 204
    h.get(f"/v1/runs/{run['id']}", expect=404)


def test_unknown_name_is_404_and_another_projects_name_is_403_whether_or_not_it_exists(h, make_harness):
    h.create_run("mine")
    assert "not found" in detail(h, f"/v1/runs/{quote(h.project + '/nope', safe='')}", 404)
    other = make_harness()
    other.create_run("theirs")
    for name in ("theirs", "no-such-run"):  # the same answer: names of other projects do not leak
        r = h.client.get(f"/v1/runs/{quote(other.project + '/' + name, safe='')}", headers=h.headers("read"))
        assert r.status_code == 403, r.text
        r = h.client.get("/v1/alerts", params={"run": f"{other.project}/{name}"}, headers=h.headers("read"))
        assert r.status_code == 403, r.text


# ---- ISO 8601 times ----------------------------------------------------------------------------------


def iso_seconds(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_times_come_as_epoch_seconds_and_iso_8601_side_by_side(h):
    run = h.create_run()
    ev = {"kind": "note", "message": "m", "data": {}}
    h.send(run["id"], qkai_rows(0, [[0.9]] * 3, events=[ev]))
    got = h.get(f"/v1/runs/{run['id']}")
    for key in ("created_at", "updated_at", "last_report_at"):
        assert got[f"{key}_iso"].endswith("+00:00") and abs(iso_seconds(got[f"{key}_iso"]) - got[key]) < 1e-3
    assert h.get("/v1/runs", project=h.project)["data"][0]["created_at_iso"] == got["created_at_iso"]
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert abs(iso_seconds(alert["starts_at_iso"]) - alert["starts_at"]) < 1e-3 and alert["ends_at_iso"] is None
    event = h.get(f"/v1/runs/{run['id']}/events")["data"][0]
    assert event["time_iso"] == "1970-01-01T00:00:00.000+00:00"
    h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"0": 0.0}, headers=h.headers("control"))
    (entry,) = h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]
    assert abs(iso_seconds(entry["at_iso"]) - entry["at"]) < 1e-3


def qkai_rows(start: int, rows: list[list], **extra) -> list[dict]:
    return [report(start + 10 * i, {"qkai": row}, **extra) for i, row in enumerate(rows)]


def test_the_alert_summary_says_the_value_is_at_onset(h):
    run = h.create_run()
    h.send(run["id"], qkai_rows(0, [[0.8], [0.85], [0.9]]))
    (alert,) = h.get("/v1/alerts", run=run["id"])["data"]
    assert alert["summary"].endswith("(0.9 at onset)"), alert["summary"]


# ---- runs by what happened in them -------------------------------------------------------------------


def names(h, **params) -> list[str]:
    body = h.get("/v1/runs", project=h.project, **params)
    assert body["count"] == len(body["data"])
    return sorted(r["name"] for r in body["data"])


def test_find_runs_by_qkai_ever_or_latest_above_and_by_collapse_band(h):
    band = [0.9, 0.9, 0.9, 0.1]
    spiked = h.create_run("spiked")  # above 0.7 once, back down since
    h.send(spiked["id"], qkai_rows(0, [[0.1] * 4, [0.1, 0.75, 0.1, 0.1], [0.1] * 4]))
    banded = h.create_run("banded")  # a collapse band, still there
    h.send(banded["id"], qkai_rows(0, [band] * 3))
    calm = h.create_run("calm")
    h.send(calm["id"], qkai_rows(0, [[0.2] * 4] * 3, scalars={"loss": 9.0}))  # a scalar above 0.7 is not QKAI
    h.create_run("empty")
    assert names(h, qkai_above=0.7) == ["banded", "spiked"]
    assert names(h, qkai_above=0.8) == ["banded"]
    assert names(h, qkai_latest_above=0.7) == ["banded"]
    assert names(h, collapse_band="true") == ["banded"]
    assert names(h, collapse_band="false") == ["calm", "empty", "spiked"]
    assert names(h, alert="qkai_high") == ["banded"]
    assert names(h, qkai_above=0.7, collapse_band="false") == ["spiked"]
    assert names(h, qkai_above=0.99) == []


def test_find_runs_by_status_and_time_range(h):
    old, new = h.create_run("old"), h.create_run("new")
    h.client.patch(f"/v1/runs/{old['id']}", json={"status": "finished"}, headers=h.headers("ingest"))
    created_old = h.get(f"/v1/runs/{old['id']}")["created_at"]
    created_new = h.get(f"/v1/runs/{new['id']}")["created_at"]
    assert names(h, status="finished") == ["old"]
    assert names(h, created_after=created_new) == ["new"]  # epoch seconds, bounds inclusive
    assert names(h, created_before=created_old) == ["old"]
    assert created_new - created_old > 1e-5
    between = datetime.fromtimestamp((created_old + created_new) / 2, timezone.utc)
    assert names(h, created_after=between.isoformat()) == ["new"]
    assert names(h, created_before=between.isoformat()) == ["old"]
    assert names(h, created_after=between.replace(tzinfo=None).isoformat()) == ["new"]  # no offset: UTC
    assert names(h, created_after=between.astimezone(timezone(timedelta(hours=5))).isoformat()) == ["new"]
    updated = h.get(f"/v1/runs/{old['id']}")["updated_at"]
    assert "old" in names(h, updated_after=updated, updated_before=updated + 1)
    assert h.client.get("/v1/runs", params={"created_after": "yesterday"}, headers=h.headers("read")).status_code == 422
    assert h.client.get("/v1/runs", params={"qkai_above": "nan"}, headers=h.headers("read")).status_code == 422


# ---- whole-run history in one call -------------------------------------------------------------------


def test_history_is_every_value_of_the_run_in_one_columnar_answer(h):
    run = four_layer_run(h)
    hist = h.get(f"/v1/runs/{run['id']}/history")
    assert set(hist["metrics"]) == {"qkai", "stable_rank", "loss"}
    qkai = hist["metrics"]["qkai"]
    assert qkai["steps"] == [0, 10, 20, 30, 40] and qkai["layers"] == [0, 1, 2, 3]
    assert qkai["values"] == [[0.1, 0.2, 0.3, 0.4]] * 5
    assert hist["metrics"]["stable_rank"]["values"][0] == [5.0, "nan", 3.0, "inf"]  # wire encoding
    assert hist["metrics"]["loss"] == {
        "steps": [0, 10, 20, 30, 40],
        "layers": [-1],
        "values": [[3.0], [2.9], [2.8], [2.7], [2.6]],
    }
    some = h.get(f"/v1/runs/{run['id']}/history", metrics="qkai,loss", start=10, end=20)
    assert set(some["metrics"]) == {"qkai", "loss"} and some["metrics"]["qkai"]["steps"] == [10, 20]
    again = h.client.get(
        f"/v1/runs/{run['id']}/history", params=[("metrics", "qkai"), ("metrics", "loss")], headers=h.headers("read")
    )
    assert set(again.json()["metrics"]) == {"qkai", "loss"}
    msg = detail(h, f"/v1/runs/{run['id']}/history", 404, metrics="qkai,nope")
    assert "'nope'" in msg and "'qkai'" not in msg.split(";")[0]


def test_history_equals_the_export_point_for_point(h):
    run = h.create_run()
    rows = [[0.1 * la + s / 1000 for la in range(3)] for s in range(20)]
    rows[7][1] = "nan"
    h.send(run["id"], [report(s, {"qkai": row}, scalars={"loss": 1.0 / (s + 1)}) for s, row in enumerate(rows)])
    hist = h.get(f"/v1/runs/{run['id']}/history")["metrics"]
    got = {
        (m, s, la): v
        for m, g in hist.items()
        for s, row in zip(g["steps"], g["values"], strict=True)
        for la, v in zip(g["layers"], row, strict=True)
        if v is not None
    }
    export = h.client.get(f"/v1/runs/{run['id']}/export", params={"format": "jsonl"}, headers=h.headers("read"))
    want = {(p["metric"], p["step"], p["layer"]): p["value"] for p in map(json.loads, export.text.splitlines())}
    assert got == want and len(got) == 20 * 4


def test_history_follows_the_latest_attempt_rule(h):
    run = h.create_run(attempt_key="a1")
    h.send(run["id"], [report(s, {"qkai": [0.1, 0.1]}, scalars={"loss": 1.0}) for s in range(0, 40, 10)])
    h.create_run(run["name"], attempt_key="a2")  # resumed from the checkpoint at step 10
    h.send(run["id"], [report(s, {"qkai": [0.2, 0.2]}, scalars={"loss": 2.0}) for s in range(20, 50, 10)])
    merged = h.get(f"/v1/runs/{run['id']}/history")["metrics"]
    assert merged["qkai"]["steps"] == [0, 10, 20, 30, 40]
    assert [row[0] for row in merged["qkai"]["values"]] == [0.1, 0.1, 0.2, 0.2, 0.2]
    assert [row[0] for row in merged["loss"]["values"]] == [1.0, 1.0, 2.0, 2.0, 2.0]
    heat = h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai", max_steps=1000)
    assert heat["values"] == merged["qkai"]["values"]  # the same rule as the other reads
    first = h.get(f"/v1/runs/{run['id']}/history", attempt=1)["metrics"]
    assert [row[0] for row in first["qkai"]["values"]] == [0.1] * 4


def test_history_of_layers_shared_out_over_ranks_and_a_missing_layer(h):
    run = h.create_run()
    h.send(run["id"], [report(5, {"qkai": [0.1, None, 0.3, None]})])
    h.send(run["id"], [report(5, {"qkai": [None, 0.2, None, None]})])
    h.send(run["id"], [report(6, {"qkai": [0.4, 0.5]})])
    g = h.get(f"/v1/runs/{run['id']}/history", metrics="qkai")["metrics"]["qkai"]
    assert g == {"steps": [5, 6], "layers": [0, 1, 2], "values": [[0.1, 0.2, 0.3], [0.4, 0.5, None]]}


def test_history_too_large_for_one_answer_is_422_asking_for_a_range(h, monkeypatch):
    run = four_layer_run(h)
    monkeypatch.setattr(queries, "MAX_HISTORY_VALUES", 10)
    msg = detail(h, f"/v1/runs/{run['id']}/history", 422)
    assert "more than 10" in msg and "start" in msg
    assert h.get(f"/v1/runs/{run['id']}/history", metrics="qkai", end=0)["metrics"]["qkai"]["steps"] == [0]


def test_history_values_are_strict_json(h):
    run = four_layer_run(h)
    r = h.client.get(f"/v1/runs/{run['id']}/history", headers=h.headers("read"))
    body = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"bare {c} in the answer"))
    assert not any(
        isinstance(v, float) and not math.isfinite(v)
        for g in body["metrics"].values()
        for row in g["values"]
        for v in row
    )


def test_history_as_doubles_is_the_same_grid(h):
    run = h.create_run()
    h.send(
        run["id"],
        [
            report(1, {"qkai": [0.25, "nan", "inf", None]}),
            report(2, {"qkai": [0.5, "-inf", 1e-300, 7.0]}),
            report(2, scalars={"loss": 1.5}),
        ],
    )
    doubles = h.get(f"/v1/runs/{run['id']}/history", encoding="f64")["metrics"]
    rows = h.get(f"/v1/runs/{run['id']}/history")["metrics"]
    q = doubles["qkai"]
    assert q["steps"] == [1, 2] and q["layers"] == [0, 1, 2, 3] and "values" not in q
    values = struct.unpack("<8d", base64.b64decode(q["values_f64"]))
    assert list(base64.b64decode(q["measured"])) == [1, 1, 1, 0, 1, 1, 1, 1]
    assert math.isnan(values[1]) and math.isnan(values[3])  # a measured NaN; not measured (its byte is 0)
    assert [values[i] for i in (0, 2, 4, 5, 6, 7)] == [0.25, math.inf, 0.5, -math.inf, 1e-300, 7.0]
    assert rows["qkai"]["values"] == [[0.25, "nan", "inf", None], [0.5, "-inf", 1e-300, 7.0]]
    assert doubles["loss"]["measured"] is None  # every value measured
    assert struct.unpack("<1d", base64.b64decode(doubles["loss"]["values_f64"])) == (1.5,)


def decoded(grid: dict) -> list[list[str]]:
    """A history grid of either encoding as rows of value reprs ("None": not measured)."""
    if "values" in grid:
        return [[repr(None if v is None else float(v)) for v in row] for row in grid["values"]]
    values = struct.unpack(f"<{len(grid['steps']) * len(grid['layers'])}d", base64.b64decode(grid["values_f64"]))
    measured = base64.b64decode(grid["measured"]) if grid["measured"] else b"\x01" * len(values)
    flat = [repr(v if m else None) for v, m in zip(values, measured, strict=True)]
    width = len(grid["layers"])
    return [flat[i : i + width] for i in range(0, len(flat), width)]


def test_history_as_doubles_equals_the_json_rows_whichever_way_it_was_stored(h):
    whole = four_layer_run(h)  # one full frame per step: passed through as stored
    resumed = h.create_run(attempt_key="a1")  # two attempts over steps 20-30: merged
    h.send(resumed["id"], [report(s, {"qkai": [0.1, "nan"]}) for s in range(0, 40, 10)])
    h.create_run(resumed["name"], attempt_key="a2")
    h.send(resumed["id"], [report(s, {"qkai": [0.2, "inf"]}) for s in range(20, 50, 10)])
    ranks = h.create_run()  # layers shared out over ranks: merged
    h.send(ranks["id"], [report(5, {"qkai": [0.1, None, 0.3]}), report(5, {"qkai": [None, 0.2, None]})])
    for run in (whole, resumed, ranks):
        for params in ({}, {"start": 10, "end": 30}, {"attempt": 1}):
            rows = h.get(f"/v1/runs/{run['id']}/history", **params)["metrics"]
            doubles = h.get(f"/v1/runs/{run['id']}/history", encoding="f64", **params)["metrics"]
            assert rows.keys() == doubles.keys()
            for name in rows:
                assert doubles[name]["steps"] == rows[name]["steps"] and doubles[name]["layers"] == rows[name]["layers"]
                assert decoded(doubles[name]) == decoded(rows[name]), (run["name"], params, name)
    merged = h.get(f"/v1/runs/{resumed['id']}/history", encoding="f64")["metrics"]["qkai"]
    assert decoded(merged) == [["0.1", "nan"], ["0.1", "nan"], ["0.2", "inf"], ["0.2", "inf"], ["0.2", "inf"]]


@given(
    st.integers(1, 5).flatmap(
        lambda width: st.tuples(
            st.just(width),
            st.lists(
                st.one_of(st.floats(), st.sampled_from([1.7976931348623157e308, -1.7976931348623157e308, -0.0])),
                max_size=4 * width,
            ).map(lambda xs: xs[: len(xs) - len(xs) % width]),
        )
    ),
    st.booleans(),
)
def test_json_rows_are_the_rows_encoded_one_by_one(width_values, with_measured):
    """The finite-sum shortcut of ``_json_rows`` gives the rows ``_enc_row`` gives, on NaN, infinities,
    -0.0 and finite values whose sum overflows."""
    width, values = width_values
    measured = bytes(i % 3 != 1 for i in range(len(values))) if with_measured else None
    flat = [v if measured is None or measured[i] else None for i, v in enumerate(values)]
    want = [queries._enc_row(flat[i : i + width]) for i in range(0, len(flat), width)]
    got = orjson.loads(queries._dumps(queries._json_rows(array("d", values).tobytes(), measured, width)))
    assert _reprs(got) == _reprs(want)


TRICKY = [0.1, 1 / 3, -0.0, 5e-324, 1.7976931348623157e308, -2.2250738585072014e-308, 1e-7, 1e16, 123456.789]


def _before(h, run_id: str, **params) -> dict:
    """``GET /history``'s JSON values as the route built them before orjson: the store's grids,
    ``_enc_row`` and ``json.dumps`` (which refuses a NaN or infinity), parsed back."""
    run = h.store.get_run(run_id)
    window = {"start": params.get("start"), "end": params.get("end"), "attempt": params.get("attempt")}
    grids = h.store.history(run, sorted(h.store.run_metrics(run)), **window, max_points=None)
    body = {
        n: {"steps": g.steps, "layers": g.layers, "values": [queries._enc_row(r) for r in g.values]}
        for n, g in grids.items()
    }
    return json.loads(json.dumps(body, allow_nan=False))


def _reprs(value):
    """``value`` with every float as its repr, so that -0.0 and 0.0 (equal as floats) differ."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return [_reprs(v) for v in value]
    if isinstance(value, dict):
        return {k: _reprs(v) for k, v in value.items()}
    return value


def test_history_json_values_are_the_values_json_dumps_gave_on_tricky_values(h):
    whole = h.create_run(config={"n_layers": len(TRICKY) + 4})
    row = [*TRICKY, "nan", "inf", "-inf", 2.5]
    h.send(whole["id"], [report(s, {"qkai": row, "pr_gap": row[::-1]}, scalars={"loss": row[s]}) for s in range(6)])
    gaps = h.create_run(attempt_key="a1")  # not measured, two attempts, layers shared out: the merged path
    h.send(gaps["id"], [report(s, {"qkai": [1e-300, None, "nan"]}, scalars={"loss": -0.0}) for s in range(0, 30, 10)])
    h.send(gaps["id"], [report(5, {"qkai": [None, 0.7, None]})])
    h.create_run(gaps["name"], attempt_key="a2")
    h.send(gaps["id"], [report(s, {"qkai": ["-inf", 3.0]}) for s in range(20, 40, 10)])
    for run in (whole, gaps):
        for params in ({}, {"start": 5, "end": 20}, {"attempt": 1}):
            r = h.client.get(f"/v1/runs/{run['id']}/history", params=params, headers=h.headers("read"))
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            body = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"bare {c} in the answer"))
            assert _reprs(body["metrics"]) == _reprs(_before(h, run["id"], **params)), (run["name"], params)
    values = h.get(f"/v1/runs/{whole['id']}/history", metrics="qkai")["metrics"]["qkai"]["values"]
    assert _reprs(values[0]) == _reprs([*TRICKY, "nan", "inf", "-inf", 2.5])  # and they are what was sent
