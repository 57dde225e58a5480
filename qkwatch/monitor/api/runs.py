"""Runs: create or resume, list and search, detail, status, tags and notes, delete, events, metrics present.

Wherever a path takes a run it is its id or ``project/name`` with the slash encoded
(``/v1/runs/demo%2Fvanilla``; see :mod:`qkwatch.monitor.api.run_ref`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from pydantic import Field

from qkwatch.contract import api
from qkwatch.contract.responses import EventPublic, EventsPublic, MetricsListPublic, RunPublic, RunsPublic
from qkwatch.contract.values import MAX_TAGS
from qkwatch.contract.wire import RunCreate, RunPatch, RunStatus, Tag
from qkwatch.monitor.api.deps import Controller, Ingester, Principal, Reader, StoreDep, load_run, require
from qkwatch.monitor.api.run_ref import RunRef, StrictRunRefRoute
from qkwatch.monitor.store.models import RunRow

router = APIRouter(tags=["runs"], route_class=StrictRunRefRoute)

QKAI = "qkai"
Time = Annotated[
    Annotated[float, Field(allow_inf_nan=False)] | datetime | None,
    Query(description="Epoch seconds, or ISO 8601 (UTC when it has no offset); inclusive"),
]


def run_public(row: RunRow, attempt: int | None = None) -> RunPublic:
    """The answer of one run; ``attempt``: the attempt to report under (a create), else the latest."""
    return RunPublic(
        id=row.id,
        project=row.project,
        name=row.name,
        status=row.status,
        status_reason=row.status_reason,
        attempt=attempt or row.latest_attempt,
        latest_attempt=row.latest_attempt,
        config=row.config.as_dict(),
        tags=tuple(row.tags),
        notes=row.notes,
        created_at=row.created_at,
        updated_at=row.updated_at,
        last_report_at=row.last_report_at,
        last_step=row.last_step,
    )


def check_attempt(run: RunRow, attempt: int | None) -> None:
    """404 for an attempt the run does not have: an empty answer would read as "nothing logged"."""
    if attempt is not None and attempt > run.latest_attempt:
        raise HTTPException(
            404, f"run {run.project}/{run.name} has no attempt {attempt} (its latest is {run.latest_attempt})"
        )


def _bounds(after: float | datetime | None, before: float | datetime | None) -> tuple[float | None, float | None]:
    """Inclusive (after, before) in epoch seconds. Epoch seconds are taken as they are; a time given
    to the microsecond (ISO 8601) covers its whole microsecond, so that a run's own time, which a
    datetime rounds to the nearest microsecond, falls inside a bound made from it."""

    def seconds(t: float | datetime | None, widen: float) -> float | None:
        if not isinstance(t, datetime):
            return t
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp() + widen

    return seconds(after, -1e-6), seconds(before, 1e-6)


@router.post(api.RUNS, response_model=RunPublic)
def create_run(body: RunCreate, store: StoreDep, principal: Ingester) -> RunPublic:
    """Create a run, or resume the one with this project and name (see ``attempt_key`` in the wire schema)."""
    principal.check_project(body.project)
    run, attempt = store.create_or_resume_run(body)
    return run_public(run, attempt)


@router.get(api.RUNS, response_model=RunsPublic)
def list_runs(
    store: StoreDep,
    principal: Reader,
    request: Request,
    project: str | None = None,
    status: RunStatus | None = None,
    name: str | None = None,
    tag: Annotated[
        list[Tag] | None,
        Query(max_length=MAX_TAGS, description="Runs that have every one of these tags (repeat it: tag=a&tag=b)"),
    ] = None,
    qkai_above: Annotated[
        float | None,
        Query(
            allow_inf_nan=False,
            description="Runs in which some layer's QKAI was above this at some report (any step, any attempt)",
        ),
    ] = None,
    qkai_latest_above: Annotated[
        float | None, Query(allow_inf_nan=False, description="Runs whose latest QKAI of some layer is above this")
    ] = None,
    collapse_band: Annotated[
        bool | None,
        Query(description="true: runs that have had a collapse band alert (firing or resolved); false: never"),
    ] = None,
    alert: Annotated[
        str | None, Query(min_length=1, max_length=128, description="Runs that have had an alert of this rule")
    ] = None,
    created_after: Time = None,
    created_before: Time = None,
    updated_after: Time = None,
    updated_before: Time = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> RunsPublic:
    """Runs visible to the caller that match every filter given, latest activity first; ``count`` is of all matches."""
    if project is not None:
        principal.check_project(project)
    projects = [project] if project is not None else principal.projects()
    alerts = []
    if collapse_band is not None:
        bands = [b.name for b in request.app.state.rules.bands] or ["collapse_band"]
        alerts.append((bands, collapse_band))
    if alert is not None:
        alerts.append(([alert], True))
    rows, count = store.search_runs(
        projects=projects,
        status=status,
        name=name,
        tags=tag or (),
        created=_bounds(created_after, created_before),
        updated=_bounds(updated_after, updated_before),
        ever_above=(QKAI, qkai_above) if qkai_above is not None else None,
        latest_above=(QKAI, qkai_latest_above) if qkai_latest_above is not None else None,
        alerts=alerts,
        limit=limit,
        offset=offset,
    )
    return RunsPublic(data=[run_public(r) for r in rows], count=count)


@router.get(api.RUN, response_model=RunPublic)
def get_run(run_id: RunRef, store: StoreDep, principal: Reader) -> RunPublic:
    return run_public(load_run(store, run_id, principal))


ANNOTATE_SCOPES = ("ingest", "control")
"""Either of these may set a run's tags and notes."""
WRITE_SCOPES = ANNOTATE_SCOPES
"""A PATCH needs one of these whatever it changes (a status needs ``ingest``)."""


@router.patch(api.RUN, response_model=RunPublic)
def patch_run(
    run_id: RunRef, body: RunPatch, store: StoreDep, principal: Annotated[Principal, Depends(require(*WRITE_SCOPES))]
) -> RunPublic:
    """Set the status, the tags or the notes, all or nothing (a token with neither ``ingest`` nor
    ``control`` is refused before its body is read).

    Status: the agent says "finished" at the end, "crashed" (with the reason) on an exception or a
    preemption; idempotent, and a status of an attempt older than the latest is ignored. It needs the
    ``ingest`` scope. Tags and notes annotate a run: the ``ingest`` scope (whoever writes the run) or
    the ``control`` scope (an operator, who may delete it) may set them; ``read`` never writes.
    """
    _check_patch_scope(principal, body)
    run = load_run(store, run_id, principal)
    return run_public(store.patch_run(run.id, body))


def _check_patch_scope(principal: Principal, body: RunPatch) -> None:
    """403 unless the principal may make every change of ``body``."""
    if body.status is not None and "ingest" not in principal.scopes:
        raise HTTPException(403, f"token {principal.name!r} lacks the 'ingest' scope (a run's status)")
    if body.annotates() and not principal.scopes & set(ANNOTATE_SCOPES):
        raise HTTPException(
            403, f"token {principal.name!r} lacks the 'ingest' or 'control' scope (a run's tags and notes)"
        )


@router.delete(api.RUN, status_code=204)
def delete_run(run_id: RunRef, store: StoreDep, principal: Controller) -> Response:
    """Delete the run with all its points, events, alerts and lambda history."""
    run = load_run(store, run_id, principal)
    store.delete_run(run.id)
    return Response(status_code=204)


@router.get(api.EVENTS, response_model=EventsPublic)
def list_events(
    run_id: RunRef,
    store: StoreDep,
    principal: Reader,
    kind: str | None = None,
    attempt: Annotated[int | None, Query(ge=1, le=2**31)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> EventsPublic:
    run = load_run(store, run_id, principal)
    check_attempt(run, attempt)
    rows = store.list_events(run, kind=kind, attempt=attempt, limit=limit)
    return EventsPublic(data=[EventPublic.model_validate(r, from_attributes=True) for r in rows], count=len(rows))


@router.get(api.METRICS, response_model=MetricsListPublic)
def list_metrics(run_id: RunRef, store: StoreDep, principal: Reader) -> MetricsListPublic:
    """The metrics this run reported, each with its layers (``[-1]``: a run-level scalar)."""
    return MetricsListPublic(metrics=store.run_metrics(load_run(store, run_id, principal)))
