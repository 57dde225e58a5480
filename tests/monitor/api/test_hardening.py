"""Findings of the red-team session (issue 10), each held on both databases: bounded free-form JSON,
export file names, override keys, one value per point on every read path, batch replays, the
layer-count bound, database trouble, /metrics auth, and a per-token rate shared by every app."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from qkwatch.monitor.main import create_app
from qkwatch.monitor.store import models as m
from tests.conftest import missing_service
from tests.monitor.conftest import PG_ADMIN_URL, _fresh_database, _pg_admin, make_settings, report


def nested(depth: int, leaf: object = 1) -> dict:
    """``{"a": {"a": ... leaf}}`` with ``depth`` dicts."""
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


# --- 2. free-form JSON is bounded at ingest --------------------------------------------------


def test_deep_run_config_is_refused_naming_the_field(h):
    body = {"project": h.project, "name": "deep", "config": nested(256)}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "config"] and "deep" in r.json()["detail"][0]["msg"]
    assert h.create_run("at-the-bound", config=nested(32))["config"] == nested(32)
    listed = h.get("/v1/runs", project=h.project)  # the 500 of the report: listing a run with a deep config
    assert [r["name"] for r in listed["data"]] == ["at-the-bound"]


def test_large_run_config_is_refused(h):
    body = {"project": h.project, "name": "big", "config": {"notes": "x" * 300_000}}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "config"], r.text


def test_deep_event_data_is_refused_and_events_stay_readable(h):
    run = h.create_run()
    deep = [report(1, events=[{"kind": "note", "data": nested(900)}])]
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        json={"batch_id": str(uuid.uuid4()), "reports": deep},
        headers=h.headers("ingest"),
    )
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "reports", 0, "events", 0, "data"]
    big = [report(1, events=[{"kind": "note", "data": {"blob": "y" * 100_000}}])]
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        json={"batch_id": str(uuid.uuid4()), "reports": big},
        headers=h.headers("ingest"),
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "data", r.text
    h.send(run["id"], [report(2, events=[{"kind": "note", "data": nested(32)}])])
    assert h.get(f"/v1/runs/{run['id']}/events")["data"][0]["data"] == nested(32)


def test_json_nested_past_the_parser_is_422_not_500(h):
    run = h.create_run()
    body = b'{"batch_id": "%s", "reports": ' % str(uuid.uuid4()).encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        content=body,
        headers={**h.headers("ingest"), "Content-Type": "application/json"},
    )
    assert r.status_code == 422 and "nested" in json.dumps(r.json()), r.text


def test_deep_json_stored_before_the_bound_is_still_readable(h):
    """Rows written before the bound existed are kept as they are; reads cut them at the bound."""
    run = h.create_run()
    h.send(run["id"], [report(1, events=[{"kind": "note", "data": {"k": 1}}])])
    with h.store.engine.begin() as conn:
        conn.execute(sa.update(m.runs).where(m.runs.c.id == run["id"]).values(config=json.dumps(nested(300))))
        conn.execute(
            sa.update(m.events)
            .values(data=json.dumps(nested(900)))
            .where(m.events.c.run_pk == sa.select(m.runs.c.pk).where(m.runs.c.id == run["id"]).scalar_subquery())
        )
    listed = h.get("/v1/runs", project=h.project)["data"][0]["config"]
    assert _depth(listed) <= 33 and "a" in listed
    assert _depth(h.get(f"/v1/runs/{run['id']}/events")["data"][0]["data"]) <= 33
    with h.store.engine.connect() as conn:  # the database keeps the whole value
        stored = conn.execute(sa.select(m.runs.c.config).where(m.runs.c.id == run["id"])).scalar_one()
    assert json.loads(stored) == nested(300)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


# --- 3. export file names ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["λ-run", "运行", "run-\U0001f680", 'we"ird\\name;x=1'])
def test_export_of_any_run_name_has_an_rfc6266_file_name(h, name: str):
    run = h.create_run(name)
    h.send(run["id"], [report(1, {"qkai": [0.5]})])
    r = h.client.get(f"/v1/runs/{run['id']}/export", headers=h.headers("read"))
    assert r.status_code == 200 and r.text.splitlines()[1] == "1,1,qkai,0,-1,0.5"
    disposition = r.headers["content-disposition"]
    assert disposition.isascii()
    ascii_part, star = disposition.split("; filename*=")
    assert star == "UTF-8''" + quote(f"{name}.csv".replace("\\", "").replace('"', ""), safe="")
    fallback = ascii_part.removeprefix('attachment; filename="').removesuffix('"')
    assert fallback.endswith(".csv") and '"' not in fallback and "\\" not in fallback


# --- 4. override keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["99999999999999999999", "3000000000", "4096", "1_000", "\u0663", "+8", " 7 ", "-1", "07", "", "1.0"]
)
def test_override_keys_must_be_plain_decimal_layer_indices(h, key: str):
    unknown_shape = h.create_run()  # no n_layers: the bound is the collector's layer limit
    for run in (unknown_shape, h.create_run(config={"n_layers": 8})):
        r = h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={key: 0.0}, headers=h.headers("control"))
        assert r.status_code == 422, r.text
        assert repr(key) in r.json()["detail"] or key in r.json()["detail"], r.text
    r = h.client.put(
        f"/v1/runs/{unknown_shape['id']}/lambdas/overrides", json={"7": 0.0, "4095": 0.0}, headers=h.headers("control")
    )
    assert r.status_code == 200 and r.json()["overrides"] == {"7": 0.0, "4095": 0.0}


# --- 5. one value per point on every read path ------------------------------------------------


def _read_everything(h, run_id: str) -> dict:
    """(step, layer) -> value as each read path sees it."""
    paths: dict[str, dict] = {"series": {}, "heatmap": {}, "export": {}}
    for layer in range(6):
        s = h.get(f"/v1/runs/{run_id}/series", metric="qkai", layer=layer)
        paths["series"].update({(st, layer): v for st, v in zip(s["steps"], s["values"], strict=True)})
    hm = h.get(f"/v1/runs/{run_id}/heatmap", metric="qkai", max_steps=1000)
    for st, row in zip(hm["steps"], hm["values"], strict=True):
        paths["heatmap"].update({(st, la): v for la, v in zip(hm["layers"], row, strict=True) if v is not None})
    for agg in ("min", "mean"):
        other = h.get(f"/v1/runs/{run_id}/heatmap", metric="qkai", max_steps=1000, agg=agg)
        assert other["values"] == hm["values"]
    lines = h.client.get(f"/v1/runs/{run_id}/export", params={"format": "jsonl"}, headers=h.headers("read")).text
    for line in lines.splitlines():
        row = json.loads(line)
        if row["metric"] == "qkai" and row["head"] == -1:
            paths["export"][(row["step"], row["layer"])] = row["value"]
    return paths


def test_a_point_sent_twice_keeps_its_first_value_everywhere(h):
    run = h.create_run(config={"n_layers": 6})
    h.send(run["id"], [report(100, {"qkai": [0.1, 0.2, 0.3, 0.4]})])
    h.send(run["id"], [report(100, {"qkai": [0.9] * 6})])  # more layers, different values
    h.send(run["id"], [report(200, {"qkai": [0.1, None, 0.3, 0.4, None, None]})])
    h.send(run["id"], [report(200, {"qkai": [0.5, 0.6, 0.7, 0.8, 0.85, 0.95]})])  # a full report after a null
    h.send(run["id"], [report(300, {"qkai": [0.3] * 6}), report(300, {"qkai": [0.7] * 6})])  # twice in one batch
    expected = {(100, la): v for la, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.9, 0.9])}
    expected |= {(200, la): v for la, v in enumerate([0.1, 0.6, 0.3, 0.4, 0.85, 0.95])}
    expected |= {(300, la): 0.3 for la in range(6)}
    for path, seen in _read_everything(h, run["id"]).items():
        assert seen == expected, path
    assert _latest(h, run) == {str(la): 0.3 for la in range(6)}  # the latest values, as /metrics exports them


def _latest(h, run: dict) -> dict[str, float]:
    text = h.client.get("/metrics", headers=h.headers("read")).text
    return {
        s.labels["layer"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "qkwatch_qkai_ratio"
        for s in f.samples
        if s.labels["run"] == run["name"] and s.labels["project"] == h.project
    }


def test_latest_keeps_the_first_value_of_its_step(h):
    run = h.create_run(config={"n_layers": 2})
    h.send(run["id"], [report(5, {"qkai": [0.1, 0.2]})])
    h.send(run["id"], [report(5, {"qkai": [0.8, 0.9]})])
    assert _latest(h, run) == {"0": 0.1, "1": 0.2}
    assert h.get(f"/v1/runs/{run['id']}/heatmap", metric="qkai")["values"] == [[0.1, 0.2]]


# --- 6. batch replays --------------------------------------------------------------------------


def test_a_replayed_batch_id_is_a_replay_on_both_databases(h):
    run = h.create_run()
    batch = str(uuid.uuid4())
    assert h.send(run["id"], [report(1, {"qkai": [0.1, 0.2]})], batch_id=batch) == {"inserted": 2, "duplicates": 0}
    replay = h.send(run["id"], [report(2, {"qkai": [0.5, 0.6, 0.7]})], batch_id=batch)  # other content, same id
    assert replay == {"inserted": 0, "duplicates": 3}
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0)["steps"] == [1]
    assert h.get(f"/v1/runs/{run['id']}")["last_step"] == 1


def test_a_resumed_attempt_resending_a_batch_id_stores_nothing_again(h):
    run = h.create_run("resumed", attempt_key="first")
    batch = str(uuid.uuid4())
    reports = [report(s, {"qkai": [0.1, 0.2]}) for s in range(3)]
    assert h.send(run["id"], reports, batch_id=batch)["inserted"] == 6
    assert h.create_run("resumed", attempt_key="second")["attempt"] == 2
    assert h.send(run["id"], reports, batch_id=batch) == {"inserted": 0, "duplicates": 6}  # no attempt: the latest
    assert h.get(f"/v1/runs/{run['id']}/series", metric="qkai", layer=0, attempt=2)["steps"] == []
    lines = h.client.get(f"/v1/runs/{run['id']}/export", headers=h.headers("read")).text.splitlines()
    assert len(lines) == 1 + 6 and all(line.startswith("1,") for line in lines[1:])


# --- 7. the layer count ------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [3_000_000, 4097, 0, -1, True, "12", 2.5, 10**400, [4]])
def test_n_layers_is_bounded(h, n_layers):
    body = {"project": h.project, "name": "huge", "config": {"n_layers": n_layers}}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "config", "n_layers"] and "config.n_layers" in error["msg"], r.text
    assert h.get("/v1/runs", project=h.project)["count"] == 0


def test_a_report_with_more_layers_than_the_bound_is_refused(h):
    run = h.create_run()
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        headers=h.headers("ingest"),
        json={"batch_id": str(uuid.uuid4()), "reports": [report(1, {"qkai": [None] * 4097})]},
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:4] == ["body", "reports", 0, "layers"], r.text


def test_a_resume_may_not_change_the_layer_count(h):
    run = h.create_run("shaped", config={"n_layers": 4})
    body = {"project": h.project, "name": "shaped", "config": {"n_layers": 4000}}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == 422 and "config.n_layers" in r.json()["detail"] and "4" in r.json()["detail"], r.text
    assert len(h.get(f"/v1/runs/{run['id']}/lambdas")["lambdas"]) == 4
    resumed = h.create_run("shaped", config={"schedule": {"lambda_0": 0.001}}, attempt_key="2")  # no n_layers: kept
    assert resumed["config"]["n_layers"] == 4 and resumed["config"]["schedule"]["lambda_0"] == 0.001
    assert h.create_run("shaped", config={"n_layers": 4})["config"]["n_layers"] == 4
    assert len(h.get(f"/v1/runs/{run['id']}/lambdas")["lambdas"]) == 4


# --- 8. database trouble -----------------------------------------------------------------------


@pytest.fixture
def own_db(isolated_db_url: str) -> str:
    """A database of its own: these tests break it."""
    return isolated_db_url


def _wipe(url: str) -> None:
    """Every table and view gone, as in a database recreated empty."""
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql("DROP SCHEMA public CASCADE")
                conn.exec_driver_sql("CREATE SCHEMA public")
                return
            names = conn.exec_driver_sql("SELECT type, name FROM sqlite_master WHERE type IN ('view', 'table')").all()
            for kind, name in sorted(names, key=lambda r: r[0] != "view"):
                conn.exec_driver_sql(f'DROP {kind.upper()} IF EXISTS "{name}"')
    finally:
        engine.dispose()


def _app_on(url: str, **overrides):
    app = create_app(make_settings(url, **overrides))
    return app, TestClient(app, raise_server_exceptions=False)


def test_an_empty_database_is_503_with_retry_after_and_not_healthy(own_db: str):
    app, client = _app_on(own_db)
    with client:
        _, secret = app.state.store.create_token("p", ["read"])
        headers = {"Authorization": f"Bearer {secret}"}
        assert client.get("/v1/runs", headers=headers).status_code == 200
        assert client.get("/healthz").json()["status"] == "ok"
        _wipe(own_db)
        r = client.get("/v1/runs", headers=headers)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert "database" in r.json()["detail"] and int(r.headers["retry-after"]) >= 1
        health = client.get("/healthz")
        assert health.status_code == 503 and health.json()["database"] != "ok", health.text


def test_a_database_behind_the_expected_revision_is_not_healthy(own_db: str):
    app, client = _app_on(own_db)
    with client:
        with app.state.store.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0003'")
        health = client.get("/healthz")
        assert health.status_code == 503 and "0003" in health.json()["database"], health.text


@pytest.fixture
def own_pg_db() -> Iterator[str]:
    """A PostgreSQL database of its own (a SQLite file cannot be taken away from an open connection)."""
    admin = _pg_admin()
    if admin is None:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    yield from _fresh_database(admin)


def test_a_dropped_postgres_database_is_503(own_pg_db: str):
    app, client = _app_on(own_pg_db)
    name = sa.make_url(own_pg_db).database
    admin = sa.create_engine(sa.make_url(own_pg_db).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with client:
        _, secret = app.state.store.create_token("p", ["read"])
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        r = client.get("/v1/runs", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 503 and "retry-after" in r.headers and r.json()["detail"], r.text
        assert client.get("/healthz").status_code == 503
        with admin.connect() as conn:  # recreated empty: still not healthy
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        assert client.get("/healthz").status_code == 503
    admin.dispose()


# --- 10. /metrics and project names ------------------------------------------------------------


def test_metrics_needs_a_read_token_and_shows_only_its_projects(make_harness):
    h = make_harness()
    mine = h.create_run("mine")
    h.send(mine["id"], [report(1, {"qkai": [0.5]})])
    other = make_harness()
    theirs = other.create_run("theirs")
    other.send(theirs["id"], [report(1, {"qkai": [0.5]})])
    assert h.client.get("/metrics").status_code == 401
    assert h.client.get("/metrics", headers=h.headers("ingest")).status_code == 403
    text = h.client.get("/metrics", headers=h.headers("read")).text
    assert f'run="{mine["name"]}"' in text and other.project not in text and "qkwatch_points_ingested_total" in text
    _, admin = h.store.create_token("*", ["read"])
    text = h.client.get("/metrics", headers={"Authorization": f"Bearer {admin}"}).text
    assert h.project in text and other.project in text


def test_metrics_can_be_public_by_choice_or_in_open_mode(make_harness):
    assert make_harness(metrics_public=True).client.get("/metrics").status_code == 200
    assert make_harness(open_access=True).client.get("/metrics").status_code == 200


def test_a_403_does_not_name_the_other_project(make_harness):
    h = make_harness()
    run = h.create_run()
    _, secret = h.store.create_token("intruder", ["ingest", "read", "control"])
    headers = {"Authorization": f"Bearer {secret}"}
    for method, path in (
        ("GET", f"/v1/runs/{run['id']}"),
        ("GET", f"/v1/runs/{run['id']}/lambdas"),
        ("GET", f"/v1/runs/{run['id']}/series?metric=qkai"),
        ("DELETE", f"/v1/runs/{run['id']}"),
        ("GET", f"/v1/compare?run={run['id']}&metric=qkai"),
    ):
        r = h.client.request(method, path, headers=headers)
        assert r.status_code == 403 and h.project not in r.text, (path, r.text)


# --- 11. the rate limit holds across app instances ----------------------------------------------


def test_the_rate_limit_holds_across_two_apps_on_one_database(make_harness):
    a = make_harness(rate_limit_per_s=0.001, rate_limit_burst=4)
    b = make_harness(rate_limit_per_s=0.001, rate_limit_burst=4)
    headers = a.headers("read")  # one token, used against both apps (two workers, or two replicas)
    codes = [(a if i % 2 else b).client.get("/v1/runs", headers=headers).status_code for i in range(8)]
    assert codes == [200] * 4 + [429] * 4
    r = b.client.get("/v1/runs", headers=headers)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_rate_limit_refills_at_the_rate_across_apps(make_harness):
    a = make_harness(rate_limit_per_s=2.0, rate_limit_burst=2)
    b = make_harness(rate_limit_per_s=2.0, rate_limit_burst=2)
    limiter_a, limiter_b = a.app.state.rate_limiter, b.app.state.rate_limiter
    key = f"k-{uuid.uuid4().hex}"
    t0 = 1_000_000.0
    assert limiter_a.acquire(key, now=t0) == 0.0
    assert limiter_b.acquire(key, now=t0) == 0.0
    assert math.isclose(limiter_a.acquire(key, now=t0), 0.5)
    assert limiter_b.acquire(key, now=t0 + 0.5) == 0.0
    assert limiter_a.acquire(f"{key}-other", now=t0 + 0.5) == 0.0
