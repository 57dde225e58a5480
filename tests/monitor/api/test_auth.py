"""Auth: bearer tokens with project and scopes, hashed at rest, rate limited; the open mode."""

from __future__ import annotations

import sqlalchemy as sa

from qkwatch.monitor.store import models as m
from tests.monitor.conftest import report


def test_missing_or_wrong_token_is_401(h):
    assert h.client.get("/v1/runs").status_code == 401
    r = h.client.get("/v1/runs", headers={"Authorization": "Bearer qkw_nope"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert h.client.get("/v1/runs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert h.client.get("/healthz").json()["status"] == "ok"  # health needs no token


def test_scopes_are_enforced(h):
    run = h.create_run()
    read_only = h.headers("read")
    r = h.client.post(
        f"/v1/runs/{run['id']}/reports",
        headers=read_only,
        json={"batch_id": "5b1e8a52-6d1c-4b7e-9a8e-2f0f6f0c1a11", "reports": [report(1)]},
    )
    assert r.status_code == 403 and "ingest" in r.json()["detail"]
    assert h.client.get(f"/v1/runs/{run['id']}", headers=h.headers("ingest")).status_code == 403
    r = h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"0": 0.1}, headers=h.headers("read", "ingest"))
    assert r.status_code == 403 and "control" in r.json()["detail"]
    assert h.client.delete(f"/v1/runs/{run['id']}", headers=read_only).status_code == 403
    assert h.client.get(f"/v1/runs/{run['id']}", headers=read_only).status_code == 200


def test_other_projects_are_forbidden(h):
    run = h.create_run()
    _, other = h.store.create_token("someone-else", ["ingest", "read", "control"])
    headers = {"Authorization": f"Bearer {other}"}
    assert h.client.get(f"/v1/runs/{run['id']}", headers=headers).status_code == 403
    r = h.client.post("/v1/runs", json={"project": h.project, "name": "x"}, headers=headers)
    assert r.status_code == 403
    listed = h.client.get("/v1/runs", headers=headers).json()
    assert run["id"] not in [r["id"] for r in listed["data"]]
    assert h.client.get("/v1/runs", params={"project": h.project}, headers=headers).status_code == 403
    _, admin = h.store.create_token("*", ["read"])
    assert h.client.get(f"/v1/runs/{run['id']}", headers={"Authorization": f"Bearer {admin}"}).status_code == 200


def test_reports_into_another_projects_run_are_refused_and_nothing_is_written(h):
    """The ingest checks the caller's project on the run it locks for the write: 403, the batch not
    stored (its id not taken either: the run's own agent may send it later), by id and by name."""
    run = h.create_run()
    _, other = h.store.create_token("someone-else", ["ingest"])
    body = {"batch_id": "0b7d2d0e-3f57-4a43-8a8e-6f0e2d6a9b11", "reports": [report(1, {"qkai": [0.5, 0.6]})]}
    for ref in (run["id"], f"{h.project}%2F{run['name']}"):
        r = h.client.post(f"/v1/runs/{ref}/reports", json=body, headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 403, r.text
        assert "someone-else" in r.json()["detail"]
    pk = h.store.get_run(run["id"]).pk
    with h.store.engine.connect() as conn:
        for table in (m.points, m.frames, m.batches):
            assert conn.execute(sa.select(sa.func.count()).where(table.c.run_pk == pk)).scalar_one() == 0, table
    assert h.send(run["id"], body["reports"], batch_id=body["batch_id"]) == {"inserted": 2, "duplicates": 0}


def test_tokens_are_stored_hashed_and_revocable(h):
    row, secret = h.store.create_token(h.project, ["read"], name="grafana")
    with h.store.engine.connect() as conn:
        stored = conn.execute(sa.select(m.tokens.c.hash).where(m.tokens.c.id == row.id)).scalar_one()
    assert secret not in stored and len(stored) == 64
    headers = {"Authorization": f"Bearer {secret}"}
    assert h.client.get("/v1/runs", headers=headers).status_code == 200
    assert h.store.revoke_token(row.id)
    assert h.client.get("/v1/runs", headers=headers).status_code == 401


def test_rate_limit_answers_429_with_retry_after(make_harness):
    h = make_harness(rate_limit_per_s=0.01, rate_limit_burst=3)
    headers = h.headers("read")
    codes = [h.client.get("/v1/runs", headers=headers).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    r = h.client.get("/v1/runs", headers=headers)
    assert int(r.headers["retry-after"]) >= 1
    _, other = h.store.create_token(h.project, ["read"])  # limits are per token
    assert h.client.get("/v1/runs", headers={"Authorization": f"Bearer {other}"}).status_code == 200


def test_open_mode_needs_no_token(make_harness):
    h = make_harness(open_access=True)
    r = h.client.post("/v1/runs", json={"project": "demo", "name": "r"})
    assert r.status_code == 200
    assert h.client.get(f"/v1/runs/{r.json()['id']}/lambdas").status_code == 200


def test_audit_records_the_token_name(h):
    run = h.create_run(config={"n_layers": 4, "schedule": {"lambda_0": 0.1}})
    _, secret = h.store.create_token(h.project, ["control", "read"], name="oncall-alice")
    r = h.client.put(
        f"/v1/runs/{run['id']}/lambdas/overrides", json={"2": 0.3}, headers={"Authorization": f"Bearer {secret}"}
    )
    assert r.status_code == 200
    audit = h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]
    assert audit[0]["who"].startswith("oncall-alice")
