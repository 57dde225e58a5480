"""The closed loop: entropy-floor lambdas from reported entropies, overrides, audit, versions."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import sqlalchemy as sa

from qkwatch.contract.scheduling import ScheduleConfig, entropy_floor
from qkwatch.monitor.store import models as m
from tests.monitor.conftest import report


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_no_layers_known_gives_empty_lambdas(h):
    run = h.create_run()
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["lambdas"] == [] and lam["version"] == 0 and lam["step"] is None and lam["source"] == "schedule"


def test_n_layers_from_config_and_zero_before_evidence(h):
    run = h.create_run(config={"n_layers": 3})
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["lambdas"] == [0.0, 0.0, 0.0] and lam["h"] == [None, None, None]


def test_lambdas_follow_the_ema_of_entropy(h):
    sched = {"lambda_0": 0.2, "h_star": 0.6, "beta": 0.1, "ema": 0.5}
    run = h.create_run(config={"schedule": sched})
    h.send(run["id"], [report(10, {"attn_entropy": [0.6, 0.9]})])
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["version"] == 1 and lam["step"] == 10 and lam["h"] == [0.6, 0.9]
    assert lam["lambdas"] == pytest.approx([0.1, 0.2 * sig(3.0)])
    h.send(run["id"], [report(20, {"attn_entropy": [0.8, None]})])  # layer 1 not measured
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["version"] == 2 and lam["step"] == 20
    assert lam["h"] == pytest.approx([0.7, 0.9])  # 0.5 * 0.6 + 0.5 * 0.8
    assert lam["lambdas"] == pytest.approx([0.2 * sig(1.0), 0.2 * sig(3.0)])


def test_replayed_and_late_entropies_do_not_move_the_ema(h):
    run = h.create_run(config={"schedule": {"ema": 0.5}})
    batch = "3d6a3c8e-4a56-4c1d-9d8e-6d2b1f3e5a7c"
    h.send(run["id"], [report(10, {"attn_entropy": [0.5]}), report(20, {"attn_entropy": [0.7]})], batch_id=batch)
    before = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert before["h"] == pytest.approx([0.6])
    h.send(run["id"], [report(10, {"attn_entropy": [0.5]}), report(20, {"attn_entropy": [0.7]})], batch_id=batch)
    h.send(run["id"], [report(5, {"attn_entropy": [0.1]})])  # late: stored, but the EMA moved past it
    after = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert after["h"] == before["h"] and after["version"] == before["version"]
    assert h.get(f"/v1/runs/{run['id']}/series", metric="attn_entropy", layer=0)["steps"] == [5, 10, 20]


def test_length_from_highest_entropy_layer(h):
    run = h.create_run()
    h.send(run["id"], [report(1, {"attn_entropy": [0.7, 0.7, 0.7, 0.7]})])
    assert len(h.get(f"/v1/runs/{run['id']}/lambdas")["lambdas"]) == 4


def test_overrides_are_validated_applied_versioned_and_audited(h):
    run = h.create_run(config={"n_layers": 4, "schedule": {"lambda_max": 0.5}})
    h.send(run["id"], [report(30, {"attn_entropy": [0.9] * 4})])
    ctl = h.headers("control")
    url = f"/v1/runs/{run['id']}/lambdas/overrides"
    for bad, needle in (
        ('{"4": 0.1}', "out of range"),
        ('{"1": 0.6}', "lambda_max"),
        ('{"1": -0.1}', "lambda_max"),
        ('{"x": 0.1}', "layer index"),
        ('{"1": 1e999}', "finite"),
        ('{"1": "0.1"}', "1"),
    ):
        r = h.client.put(url, content=bad.encode(), headers={**ctl, "content-type": "application/json"})
        assert r.status_code == 422, (bad, r.text)
        assert needle in str(r.json()["detail"]), (bad, r.text)
    r = h.client.put(url, content=b'{"1": NaN}', headers={**ctl, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "1"]
    v0 = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert v0["overrides"] == {}  # nothing half-applied
    r = h.client.put(url, json={"3": 0.0, "1": 0.5}, headers=ctl)
    assert r.status_code == 200
    lam = r.json()
    assert lam["overrides"] == {"1": 0.5, "3": 0.0} and lam["version"] == v0["version"] + 1
    assert lam["lambdas"][1] == 0.5 and lam["lambdas"][3] == 0.0
    assert lam["lambdas"][0] == pytest.approx(v0["lambdas"][0])
    r = h.client.put(url, json={"3": None}, headers=ctl)
    assert r.json()["overrides"] == {"1": 0.5} and r.json()["version"] == v0["version"] + 2
    unchanged = h.client.put(url, json={"1": 0.5}, headers=ctl).json()
    assert unchanged["version"] == v0["version"] + 2
    audit = h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]
    assert [(a["layer"], a["old"], a["new"], a["step"]) for a in audit] == [
        (1, None, 0.5, 30),
        (3, None, 0.0, 30),
        (3, 0.0, None, 30),
    ]
    assert all(a["who"] and a["at"] > 0 for a in audit)


def test_overrides_before_the_first_report(h):
    run = h.create_run(config={"schedule": {"lambda_max": 1.0}})
    r = h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"5": 0.25}, headers=h.headers("control"))
    assert r.status_code == 200 and r.json()["overrides"] == {"5": 0.25} and r.json()["version"] == 1
    h.send(run["id"], [report(1, {"attn_entropy": [0.5] * 8})])
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["lambdas"][5] == 0.25 and len(lam["lambdas"]) == 8 and lam["version"] == 2


def test_a_resume_that_lowers_lambda_max_clips_the_overrides_with_audit_and_event(h):
    # the operator steers under a generous bound, before the trainer sends its own config
    run = h.create_run(name="steered", config={"n_layers": 4, "schedule": {"lambda_max": 1.0}}, attempt_key="a1")
    ctl = h.headers("control")
    h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"1": 0.5, "2": 0.02, "3": 0.1}, headers=ctl)
    before = h.get(f"/v1/runs/{run['id']}/lambdas")
    resumed = h.create_run(name="steered", config={"n_layers": 4, "schedule": {"lambda_max": 0.1}}, attempt_key="a2")
    assert resumed["attempt"] == 2
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["overrides"] == {"1": 0.1, "2": 0.02, "3": 0.1}  # only the one above the bound changed
    assert lam["lambdas"][1:] == [0.1, 0.02, 0.1] and lam["version"] == before["version"] + 1
    *_, clip = h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]
    assert (clip["layer"], clip["old"], clip["new"]) == (1, 0.5, 0.1)
    assert clip["who"] == "collector: lambda_max of the run's config"
    (event,) = h.get(f"/v1/runs/{run['id']}/events", kind="overrides_clipped")["data"]
    assert event["attempt"] == 2 and "lambda_max=0.1" in event["message"]
    assert event["data"] == {"layers": [{"layer": 1, "requested": 0.5, "applied": 0.1}], "lambda_max": 0.1}
    h.create_run(name="steered", config={"n_layers": 4, "schedule": {"lambda_max": 0.1}}, attempt_key="a2")
    assert len(h.get(f"/v1/runs/{run['id']}/lambdas/audit")["data"]) == 4  # nothing more to clip: no entry


def test_lambdas_never_serve_a_value_above_lambda_max(h):
    run = h.create_run(config={"n_layers": 2, "schedule": {"lambda_max": 0.1}})
    with h.store.engine.begin() as conn:  # an override stored before clipping existed
        pk = conn.execute(sa.select(m.runs.c.pk).where(m.runs.c.id == run["id"])).scalar_one()
        conn.execute(sa.insert(m.lambda_overrides).values(run_pk=pk, layer=1, value=0.7))
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["lambdas"] == [0.0, 0.1] and lam["overrides"] == {"1": 0.1}


def test_a_run_stored_with_a_schedule_the_api_now_refuses_runs_on_the_default_one(h):
    """An older collector stored configs unchecked: such a run still ingests and serves lambdas (it was a 500)."""
    run = h.create_run(config={"n_layers": 2})
    with h.store.engine.begin() as conn:
        stored = json.dumps({"schedule": {"beta": 0, "ema": 10**400}, "n_layers": 2, "lr": 0.1})
        conn.execute(sa.update(m.runs).where(m.runs.c.id == run["id"]).values(config=stored))
    h.send(run["id"], [report(1, {"attn_entropy": [0.9, 0.5]})])
    lam = h.get(f"/v1/runs/{run['id']}/lambdas")
    assert lam["schedule"] == dataclasses.asdict(ScheduleConfig())
    assert lam["lambdas"] == pytest.approx(entropy_floor([0.9, 0.5], ScheduleConfig()))
    assert h.get(f"/v1/runs/{run['id']}")["config"] == {"n_layers": 2, "lr": 0.1}  # served as the collector reads it
    limit = ScheduleConfig().lambda_max
    ctl = h.headers("control")
    assert h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"1": limit}, headers=ctl).status_code == 200
    assert (
        h.client.put(f"/v1/runs/{run['id']}/lambdas/overrides", json={"1": 2 * limit}, headers=ctl).status_code == 422
    )
