"""How a run ended: PATCH with a reason and an attempt, and what must not undo it."""

from __future__ import annotations

from tests.monitor.conftest import report


def patch(h, run_id: str, expect: int = 200, **body) -> dict:
    r = h.client.patch(f"/v1/runs/{run_id}", json=body, headers=h.headers("ingest"))
    assert r.status_code == expect, r.text
    return r.json()


def test_the_reason_is_stored_and_defaults_to_patch(h):
    run = h.create_run()
    ended = patch(h, run["id"], status="crashed", reason="RuntimeError: boom")
    assert ended["status"] == "crashed" and ended["status_reason"] == "RuntimeError: boom"
    again = patch(h, run["id"], status="crashed", reason="RuntimeError: boom")  # idempotent
    assert again["status_reason"] == "RuntimeError: boom"
    assert patch(h, run["id"], status="finished")["status_reason"] == "patch"
    long = "preempted: SIGTERM at step 1200, checkpointed; continue with --resume " + "x" * 120
    assert patch(h, run["id"], status="crashed", reason=long)["status_reason"] == long  # 190 characters fit


def test_a_bad_reason_or_attempt_is_422_naming_the_field(h):
    run = h.create_run()
    detail = patch(h, run["id"], expect=422, status="crashed", reason="x" * 201)["detail"]
    assert detail[0]["loc"] == ["body", "reason"]
    assert "no attempt 2" in patch(h, run["id"], expect=422, status="finished", attempt=2)["detail"]
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "running"  # nothing applied


def test_late_reports_and_the_same_attempt_registering_again_keep_a_finished_run_finished(h):
    run = h.create_run(attempt_key="job-1")
    patch(h, run["id"], status="finished", attempt=1)
    h.send(run["id"], [report(9, {"qkai": [0.1]})], attempt=1)  # another rank's last reports
    again = h.create_run(run["name"], attempt_key="job-1")  # that rank's sender, or qkwatch sync
    assert again["attempt"] == 1 and again["status"] == "finished" and again["status_reason"] == "patch"
    resumed = h.create_run(run["name"], attempt_key="job-2")  # a new process: a resume
    assert resumed["attempt"] == 2 and resumed["status"] == "running" and resumed["status_reason"] is None


def test_a_stale_guess_revives_when_its_attempt_registers_again(make_harness):
    h = make_harness(stale_timeout_s=60)
    run = h.create_run(attempt_key="job-1")
    h.app.state.background.run_once(now=run["updated_at"] + 61)
    assert h.get(f"/v1/runs/{run['id']}")["status_reason"] == "stale"
    assert h.create_run(run["name"], attempt_key="job-1")["status"] == "running"


def test_the_status_of_an_earlier_attempt_does_not_end_the_resumed_one(h):
    run = h.create_run(attempt_key="job-1")
    h.create_run(run["name"], attempt_key="job-2")  # resumed before attempt 1's status arrived
    late = patch(h, run["id"], status="crashed", reason="preempted: SIGTERM at step 5", attempt=1)
    assert late["status"] == "running" and late["status_reason"] is None
    assert patch(h, run["id"], status="finished", attempt=2)["status"] == "finished"
