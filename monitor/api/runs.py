"""Runs: create or resume, list, detail, status, delete, events, metrics present."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from monitor.api.deps import Controller, Ingester, Reader, StoreDep, load_run
from monitor.api.schemas import EventPublic, EventsPublic, MetricsListPublic, RunPublic, RunsPublic
from monitor.api.strict_json import StrictJSONRoute
from monitor.wire import RunCreate, RunStatus, StatusPatch

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=StrictJSONRoute)


@router.post("", response_model=RunPublic)
def create_run(body: RunCreate, store: StoreDep, principal: Ingester) -> RunPublic:
    """Create a run, or resume the one with this project and name (see ``attempt_key`` in the wire schema)."""
    principal.check_project(body.project)
    run, attempt = store.create_or_resume_run(body)
    return RunPublic.of(run, attempt)


@router.get("", response_model=RunsPublic)
def list_runs(store: StoreDep, principal: Reader, project: str | None = None, status: RunStatus | None = None,
              name: str | None = None, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              offset: Annotated[int, Query(ge=0, le=2**31)] = 0) -> RunsPublic:
    if project is not None:
        principal.check_project(project)
    projects = [project] if project is not None else principal.projects()
    rows, count = store.list_runs(projects=projects, status=status, name=name, limit=limit, offset=offset)
    return RunsPublic(data=[RunPublic.of(r) for r in rows], count=count)


@router.get("/{run_id}", response_model=RunPublic)
def get_run(run_id: str, store: StoreDep, principal: Reader) -> RunPublic:
    return RunPublic.of(load_run(store, run_id, principal))


@router.patch("/{run_id}", response_model=RunPublic)
def patch_run(run_id: str, body: StatusPatch, store: StoreDep, principal: Ingester) -> RunPublic:
    """Set the status: the agent says "finished" at the end, "crashed" (with the reason) on an exception
    or a preemption. Idempotent; a status of an attempt older than the latest is ignored."""
    load_run(store, run_id, principal)
    return RunPublic.of(store.set_status(run_id, body.status, body.reason, body.attempt))


@router.delete("/{run_id}", status_code=204)
def delete_run(run_id: str, store: StoreDep, principal: Controller) -> Response:
    """Delete the run with all its points, events, alerts and lambda history."""
    load_run(store, run_id, principal)
    store.delete_run(run_id)
    return Response(status_code=204)


@router.get("/{run_id}/events", response_model=EventsPublic)
def list_events(run_id: str, store: StoreDep, principal: Reader, kind: str | None = None,
                attempt: Annotated[int | None, Query(ge=1, le=2**31)] = None,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> EventsPublic:
    run = load_run(store, run_id, principal)
    rows = store.list_events(run, kind=kind, attempt=attempt, limit=limit)
    return EventsPublic(data=[EventPublic.of(r) for r in rows], count=len(rows))


@router.get("/{run_id}/metrics", response_model=MetricsListPublic)
def list_metrics(run_id: str, store: StoreDep, principal: Reader) -> MetricsListPublic:
    """The metrics this run reported, each with its layers (``[-1]``: a run-level scalar)."""
    return MetricsListPublic(metrics=store.run_metrics(load_run(store, run_id, principal)))
