"""Tags and notes of runs through the API, on SQLite and PostgreSQL: set on create, added on a resume,
changed by PATCH, searched by, bounded, and refused whole (nothing stored changes) when bad."""

from __future__ import annotations

import logging
import uuid

import pytest
import sqlalchemy as sa

from qkwatch.contract.values import MAX_NOTES_BYTES, MAX_TAGS
from qkwatch.monitor.store import models as m
from tests.monitor.conftest import Harness, report


def create(h: Harness, name: str | None = None, expect: int = 200, **body) -> dict:
    body = {"project": h.project, "name": name or f"run-{uuid.uuid4().hex[:8]}", **body}
    r = h.client.post("/v1/runs", json=body, headers=h.headers("ingest"))
    assert r.status_code == expect, r.text
    return r.json()


def patch(h: Harness, run_id: str, expect: int = 200, scopes: tuple[str, ...] = ("ingest",), **body) -> dict:
    r = h.client.patch(f"/v1/runs/{run_id}", json=body, headers=h.headers(*scopes))
    assert r.status_code == expect, r.text
    return r.json()


def listed(h: Harness, *tags: str, **params) -> list[str]:
    """Names of the project's runs that have every one of ``tags`` (with the other filters)."""
    query = [("project", h.project), *(("tag", t) for t in tags), *params.items()]
    r = h.client.get("/v1/runs", params=query, headers=h.headers("read"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["data"])
    return sorted(run["name"] for run in body["data"])


def stored_tags(h: Harness, run_id: str) -> list[str]:
    """The run's tags as the table holds them (not through the code under test's read)."""
    with h.store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(m.run_tags.c.tag).join(m.runs, m.runs.c.pk == m.run_tags.c.run_pk).where(m.runs.c.id == run_id)
        ).scalars()
        return sorted(rows)


def test_a_run_is_created_with_tags_and_notes_and_every_read_shows_them(h):
    notes = "baseline for the lr sweep\n\n* warmup 2k\n* `lr=3e-4`, é"
    run = create(h, tags=["lr=3e-4", "baseline", "sweep/a", "baseline"], notes=notes)
    assert run["tags"] == ["baseline", "lr=3e-4", "sweep/a"] and run["notes"] == notes
    assert stored_tags(h, run["id"]) == ["baseline", "lr=3e-4", "sweep/a"]
    detail = h.get(f"/v1/runs/{run['id']}")
    assert (detail["tags"], detail["notes"]) == (run["tags"], notes)
    by_name = h.get(f"/v1/runs/{h.project}%2F{run['name']}")
    assert (by_name["tags"], by_name["notes"]) == (run["tags"], notes)
    (row,) = h.get("/v1/runs", project=h.project)["data"]
    assert (row["tags"], row["notes"]) == (run["tags"], notes)
    plain = create(h)
    assert (plain["tags"], plain["notes"]) == ([], None)


def test_a_resume_adds_tags_and_keeps_notes_already_set(h):
    run = create(h, tags=["baseline"], notes="as the job started", attempt_key="job-1")
    patch(h, run["id"], notes="edited: diverged at 2k, restarted with clipping")
    patch(h, run["id"], add_tags=["diverged"])
    resumed = create(h, run["name"], tags=["baseline", "clipped"], notes="as the job started", attempt_key="job-2")
    assert resumed["attempt"] == 2
    assert resumed["tags"] == ["baseline", "clipped", "diverged"]  # nothing taken away
    assert resumed["notes"] == "edited: diverged at 2k, restarted with clipping"  # the edit survives
    replayed = create(h, run["name"], tags=["baseline"], notes="as the job started", attempt_key="job-1")  # sync
    assert replayed["tags"] == resumed["tags"] and replayed["notes"] == resumed["notes"]
    bare = create(h, attempt_key="k")
    assert create(h, bare["name"], notes="set on the resume", attempt_key="k2")["notes"] == "set on the resume"


def test_a_resume_past_the_bound_adds_what_fits_and_is_never_refused(h, caplog):
    run = create(h, tags=[f"t{i:02d}" for i in range(MAX_TAGS - 1)])
    with caplog.at_level(logging.WARNING, logger="qkwatch.monitor.store.runs.lifecycle"):
        resumed = create(h, run["name"], tags=["x1", "x2", "x3", "t00"])
    assert len(resumed["tags"]) == MAX_TAGS and "x1" in resumed["tags"] and "x2" not in resumed["tags"]
    assert "x2, x3 left out" in caplog.text
    assert resumed["attempt"] == 1 and resumed["status"] == "running"


def test_patch_replaces_adds_and_removes_tags_and_sets_notes_without_moving_updated_at(h):
    run = create(h, tags=["a"])
    assert patch(h, run["id"], tags=["x", "y"])["tags"] == ["x", "y"]
    assert patch(h, run["id"], add_tags=["z", "x"])["tags"] == ["x", "y", "z"]
    assert patch(h, run["id"], remove_tags=["x", "never-had"])["tags"] == ["y", "z"]
    assert patch(h, run["id"], add_tags=["w"], remove_tags=["y"])["tags"] == ["w", "z"]
    assert patch(h, run["id"], notes="first")["notes"] == "first"
    assert patch(h, run["id"], add_tags=["v"])["notes"] == "first"  # notes left out: kept
    assert patch(h, run["id"], notes="")["notes"] is None
    patch(h, run["id"], notes="again")
    assert patch(h, run["id"], notes=None)["notes"] is None
    ended = patch(h, run["id"], status="finished", tags=[])
    assert (ended["status"], ended["tags"]) == ("finished", [])
    assert stored_tags(h, run["id"]) == []
    after = h.get(f"/v1/runs/{run['id']}")
    assert after["updated_at"] == ended["updated_at"]  # the status moved it
    patch(h, run["id"], tags=["late"], notes="a note after the end")
    assert h.get(f"/v1/runs/{run['id']}")["updated_at"] == ended["updated_at"]  # annotations do not
    assert h.get(f"/v1/runs/{run['id']}")["status"] == "finished"  # nor revive the run


def test_search_by_one_tag_and_by_several(h):
    create(h, "both", tags=["baseline", "lr=3e-4"])
    create(h, "one", tags=["baseline"])
    other = create(h, "other", tags=["lr=3e-4", "sweep/a"])
    create(h, "none")
    assert listed(h, "baseline") == ["both", "one"]
    assert listed(h, "lr=3e-4") == ["both", "other"]
    assert listed(h, "baseline", "lr=3e-4") == ["both"]
    assert listed(h, "baseline", "baseline") == ["both", "one"]  # a tag given twice is one condition
    assert listed(h, "baseline", "sweep/a") == []
    assert listed(h, "nobody-has-it") == []
    assert listed(h) == ["both", "none", "one", "other"]
    patch(h, other["id"], status="finished")
    assert listed(h, "lr=3e-4", status="finished") == ["other"]
    assert listed(h, "lr=3e-4", status="running") == ["both"]
    r = h.client.get("/v1/runs", params={"tag": "baseline"}, headers=h.headers("read"))  # the token's project
    assert sorted(x["name"] for x in r.json()["data"]) == ["both", "one"]


def test_bad_tags_are_422_naming_the_field_and_nothing_stored_changes(h):
    name = f"run-{uuid.uuid4().hex[:8]}"
    detail = create(h, name, expect=422, tags=["ok", "not ok"])["detail"]
    assert detail[0]["loc"] == ["body", "tags", 1] and "no space or comma" in detail[0]["msg"]
    h.get(f"/v1/runs/{h.project}%2F{name}", expect=404)  # not created
    too_many = create(h, name, expect=422, tags=[f"t{i}" for i in range(MAX_TAGS + 1)])["detail"]
    assert too_many[0]["loc"] == ["body", "tags"] and f"at most {MAX_TAGS}" in too_many[0]["msg"]
    for bad in ("a,b", "", "x" * 65, "-leading", "ünï", "a b"):
        assert create(h, name, expect=422, tags=[bad])["detail"][0]["loc"] == ["body", "tags", 0], bad
    assert create(h, name, expect=422, tags="baseline")["detail"][0]["loc"] == ["body", "tags"]

    run = create(h, tags=["keep"], notes="kept")
    for body, loc in (
        ({"add_tags": ["fine", "bad,tag"]}, ["body", "add_tags", 1]),
        ({"remove_tags": ["bad tag"]}, ["body", "remove_tags", 0]),
        ({"tags": ["x" * 65]}, ["body", "tags", 0]),
        ({"status": "finished", "tags": ["fine", "bad tag"], "notes": "changed"}, ["body", "tags", 1]),
    ):
        assert patch(h, run["id"], expect=422, **body)["detail"][0]["loc"] == loc, body
    for body, words in (
        ({}, "nothing to change"),
        ({"tags": ["a"], "add_tags": ["b"]}, "give it alone"),
        ({"add_tags": ["a"], "remove_tags": ["a"]}, "in both"),
        ({"reason": "why", "tags": ["a"]}, "go with a status"),
    ):
        assert words in patch(h, run["id"], expect=422, **body)["detail"][0]["msg"], body
    patch(h, run["id"], tags=[f"t{i}" for i in range(MAX_TAGS)])
    full = patch(h, run["id"], expect=422, status="crashed", add_tags=["one-more"], notes="changed")["detail"]
    assert full.startswith("add_tags:") and f"at most {MAX_TAGS}" in full
    after = h.get(f"/v1/runs/{run['id']}")
    assert (after["status"], after["notes"], len(after["tags"])) == ("running", "kept", MAX_TAGS)
    assert "one-more" not in stored_tags(h, run["id"])
    swapped = patch(h, run["id"], add_tags=["one-more"], remove_tags=["t1"])["tags"]  # one for one: no growth
    assert len(swapped) == MAX_TAGS and "one-more" in swapped and "t1" not in swapped

    r = h.client.get("/v1/runs", params={"tag": "not ok"}, headers=h.headers("read"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "tag", 0]


def test_notes_are_bounded_in_bytes_and_refuse_control_characters(h):
    run = create(h)
    fits = "é" * (MAX_NOTES_BYTES // 2)  # two bytes each in UTF-8
    assert patch(h, run["id"], notes=fits)["notes"] == fits
    detail = patch(h, run["id"], expect=422, notes=fits + "x")["detail"]
    assert detail[0]["loc"] == ["body", "notes"] and f"limit is {MAX_NOTES_BYTES}" in detail[0]["msg"]
    for bad in ("a\x00b", "bell\x07", "esc\x1b[31m"):
        assert patch(h, run["id"], expect=422, notes=bad)["detail"][0]["loc"] == ["body", "notes"]
    assert create(h, expect=422, notes="x" * (MAX_NOTES_BYTES + 1))["detail"][0]["loc"] == ["body", "notes"]
    assert h.get(f"/v1/runs/{run['id']}")["notes"] == fits
    ok = "tabs\tand\r\nnewlines"
    assert patch(h, run["id"], notes=ok)["notes"] == ok


@pytest.mark.parametrize(
    ("scopes", "body", "expect"),
    [
        (("read",), {"add_tags": ["x"]}, 403),
        (("read",), {"notes": "x"}, 403),
        (("control",), {"add_tags": ["x"], "notes": "x"}, 200),
        (("ingest",), {"add_tags": ["x"], "notes": "x"}, 200),
        (("control",), {"status": "finished"}, 403),
        (("control",), {"status": "finished", "add_tags": ["x"]}, 403),
        (("ingest",), {"status": "finished", "add_tags": ["x"]}, 200),
    ],
)
def test_tags_and_notes_need_ingest_or_control_and_read_never_writes(h, scopes, body, expect):
    run = create(h, tags=["a"], notes="n")
    answer = patch(h, run["id"], expect=expect, scopes=scopes, **body)
    after = h.get(f"/v1/runs/{run['id']}")
    if expect == 403:
        assert "lacks the" in answer["detail"]
        assert (after["tags"], after["notes"], after["status"]) == (["a"], "n", "running")
    else:
        assert after["tags"] == ["a", "x"] and after["status"] == body.get("status", "running")


def test_another_projects_token_cannot_tag_and_a_deleted_run_leaves_no_tags(h, make_harness):
    mine = f"mine-{uuid.uuid4().hex[:8]}"  # one PostgreSQL database serves the session: a tag of this test only
    run = create(h, tags=[mine])
    other = make_harness()
    r = other.client.patch(f"/v1/runs/{run['id']}", json={"add_tags": ["theirs"]}, headers=other.headers("ingest"))
    assert r.status_code == 403 and stored_tags(h, run["id"]) == [mine]
    h.send(run["id"], [report(0, {"qkai": [0.1]})])
    assert h.client.delete(f"/v1/runs/{run['id']}", headers=h.headers("control")).status_code == 204
    with h.store.engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(m.run_tags).where(m.run_tags.c.tag == mine))
        assert left.scalar() == 0
