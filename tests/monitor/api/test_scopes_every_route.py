"""Red team, who may see what (issue 34): every route of the app, enumerated from its own router.

Project A's token, with every scope, tries each route on project B's run (by id and by
``project/name``): nothing of B is read, written, tagged or deleted (a 403 or 404, and B's run is
as it was after every attempt); the routes that list (runs, alerts, ``/metrics``) never show B. A
read token cannot write, and an ingest token cannot change the lambdas. The live page reads the same
REST routes (it polls; there is no websocket or server-sent-events route to guard). A route added
to the app without a row here fails ``test_every_route_has_a_row``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.monitor.conftest import Harness, report

B = "project-b"
Request = Callable[[str], dict[str, Any]]
"""A run reference -> the keyword arguments of a TestClient request for one route."""


def _batch(ref: str) -> dict[str, Any]:
    return {"json": {"batch_id": str(uuid.uuid4()), "reports": [report(99, {"qkai": [0.9]})]}}


RUN_ROUTES: dict[tuple[str, str], Request] = {
    ("get", "/v1/runs/{run_id}"): lambda ref: {},
    ("patch", "/v1/runs/{run_id}"): lambda ref: {"json": {"status": "crashed", "add_tags": ["pwned"], "notes": "x"}},
    ("delete", "/v1/runs/{run_id}"): lambda ref: {},
    ("get", "/v1/runs/{run_id}/events"): lambda ref: {},
    ("get", "/v1/runs/{run_id}/metrics"): lambda ref: {},
    ("post", "/v1/runs/{run_id}/reports"): _batch,
    ("get", "/v1/runs/{run_id}/series"): lambda ref: {"params": {"metric": "qkai", "layer": 0}},
    ("get", "/v1/runs/{run_id}/heatmap"): lambda ref: {"params": {"metric": "qkai"}},
    ("get", "/v1/runs/{run_id}/history"): lambda ref: {"params": {"metrics": "qkai"}},
    ("get", "/v1/runs/{run_id}/export"): lambda ref: {},
    ("get", "/v1/runs/{run_id}/lambdas"): lambda ref: {},
    ("put", "/v1/runs/{run_id}/lambdas/overrides"): lambda ref: {"json": {"0": 0.0}},
    ("get", "/v1/runs/{run_id}/lambdas/audit"): lambda ref: {},
}
"""Routes on one run: A's token must get nothing of B's."""
PROJECT_ROUTES: dict[tuple[str, str], Request] = {
    ("post", "/v1/runs"): lambda ref: {"json": {"project": B, "name": "planted", "config": {}}},
    ("get", "/v1/compare"): lambda ref: {"params": {"run": ref, "metric": "qkai", "layer": 0}},
    ("get", "/v1/alerts"): lambda ref: {"params": {"run": ref}},
}
"""Routes that name B's project or run another way: refused."""
LISTS = [("get", "/v1/runs"), ("get", "/v1/alerts"), ("get", "/metrics")]
"""Routes that list: answered, without anything of B."""
NO_PROJECT_DATA = [("get", "/healthz"), ("get", "/"), ("get", "/ui/config.json"), ("get", "/ui/plotly.min.js")]
"""Routes that hold nothing of any project (the page, its script and config, health)."""
WRITES = [k for k in RUN_ROUTES if k[0] != "get"]


def schema_routes(h: Harness) -> set[tuple[str, str]]:
    return {(m, p) for p, ops in h.app.openapi()["paths"].items() for m in ops}  # type: ignore[attr-defined]


def setup(h: Harness) -> tuple[dict, str]:
    """B's run (by B's own token, with an alert firing), and A's token with every scope."""
    _, b_token = h.store.create_token(B, ["ingest", "read", "control"], name="b")
    b = {"Authorization": f"Bearer {b_token}"}
    run = h.client.post("/v1/runs", json={"project": B, "name": "secret-run", "config": {"n_layers": 1}}, headers=b)
    assert run.status_code == 200, run.text
    body = {"batch_id": str(uuid.uuid4()), "reports": [report(s, {"qkai": [0.95]}) for s in (0, 5, 10, 15)]}
    assert h.client.post(f"/v1/runs/{run.json()['id']}/reports", json=body, headers=b).status_code == 200
    h.create_run("mine", {"n_layers": 1})
    return run.json(), b_token


def snapshot(h: Harness, run_id: str, b_token: str) -> dict[str, Any]:
    b = {"Authorization": f"Bearer {b_token}"}
    got = h.client.get(f"/v1/runs/{run_id}", headers=b).json()
    points = h.client.get(f"/v1/runs/{run_id}/export", params={"format": "jsonl"}, headers=b).text
    lambdas = h.client.get(f"/v1/runs/{run_id}/lambdas", headers=b).json()
    return {"run": {k: got[k] for k in ("status", "tags", "notes", "last_step")}, "points": points, "lambdas": lambdas}


def test_every_route_has_a_row(h: Harness) -> None:
    assert schema_routes(h) == set(RUN_ROUTES) | set(PROJECT_ROUTES) | {("get", "/v1/runs"), ("get", "/healthz")}


def test_a_token_of_project_a_gets_nothing_of_project_b_on_any_route(h: Harness) -> None:
    run, b_token = setup(h)
    before = snapshot(h, run["id"], b_token)
    a = h.headers("ingest", "read", "control")
    tried = 0
    for (method, path), make in {**RUN_ROUTES, **PROJECT_ROUTES}.items():
        for ref in (run["id"], f"{B}/secret-run"):
            url = path.replace("{run_id}", ref.replace("/", "%2F"))
            r = h.client.request(method.upper(), url, headers=a, **make(ref))
            assert r.status_code in (403, 404), (method, path, ref, r.status_code, r.text[:200])
            assert "secret-run" not in r.text, (method, path, r.text[:200])  # the answer names nothing of B
            tried += 1
    assert tried == 2 * (len(RUN_ROUTES) + len(PROJECT_ROUTES))
    assert snapshot(h, run["id"], b_token) == before  # nothing written, tagged, overridden or deleted
    for method, path in LISTS:
        r = h.client.request(method.upper(), path, headers=h.headers("read"))
        assert r.status_code == 200, (path, r.text[:200])
        assert "secret-run" not in r.text and run["id"] not in r.text and B not in r.text, path
    for method, path in NO_PROJECT_DATA:
        r = h.client.request(method.upper(), path)
        assert r.status_code == 200 and "secret-run" not in r.text, path


@pytest.mark.parametrize(("method", "path"), WRITES)
def test_a_read_token_cannot_write(h: Harness, method: str, path: str) -> None:
    mine = h.create_run("own", {"n_layers": 1})
    r = h.client.request(
        method.upper(),
        path.replace("{run_id}", mine["id"]),
        headers=h.headers("read"),
        **RUN_ROUTES[(method, path)](mine["id"]),
    )
    assert r.status_code == 403 and "lacks the" in r.json()["detail"], r.text
    assert h.client.get(f"/v1/runs/{mine['id']}", headers=h.headers("read")).status_code == 200  # still there


def test_an_ingest_token_cannot_change_the_lambdas(h: Harness) -> None:
    mine = h.create_run("own", {"n_layers": 2})
    r = h.client.put(f"/v1/runs/{mine['id']}/lambdas/overrides", json={"0": 0.0}, headers=h.headers("ingest"))
    assert r.status_code == 403 and "control" in r.json()["detail"]
    assert h.get(f"/v1/runs/{mine['id']}/lambdas")["overrides"] == {}
