"""Ingest: ``POST /v1/runs/{id}/reports``."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from qkwatch.contract import api
from qkwatch.contract.responses import IngestPublic
from qkwatch.contract.wire import ReportBatch
from qkwatch.monitor.api.deps import Ingester, SettingsDep, StoreDep, load_run
from qkwatch.monitor.api.run_ref import RunRef, StrictRunRefRoute

router = APIRouter(tags=["ingest"], route_class=StrictRunRefRoute)


@router.post(
    api.REPORTS,
    response_model=IngestPublic,
    responses={
        404: {"description": "unknown run"},
        413: {"description": "body or batch too large"},
        422: {"description": "an attempt the run does not have, or more metric names than a run may have"},
    },
)
def add_reports(
    run_id: RunRef, body: ReportBatch, request: Request, store: StoreDep, settings: SettingsDep, principal: Ingester
) -> IngestPublic:
    """Store a batch of reports whole or not at all, once: a replayed ``batch_id`` or an already
    stored (run, attempt, step, metric, layer, head) is counted in ``duplicates``, not stored again."""
    if "/" in run_id:  # project/name: its id (the project checked before the lookup)
        run_id = load_run(store, run_id, principal).id
    if len(body.reports) > settings.max_reports_per_batch:
        raise HTTPException(
            413, f"reports: {len(body.reports)} reports in one batch; the limit is {settings.max_reports_per_batch}"
        )
    n = body.point_count()
    if n > settings.max_points_per_batch:
        raise HTTPException(413, f"reports: {n} points in one batch; the limit is {settings.max_points_per_batch}")
    # The run is read once, locked for the write; the caller's project is checked on it there.
    result = store.add_reports(
        run_id,
        body,
        request.app.state.rules,
        max_metric_names=settings.max_metric_names_per_run,
        allow=lambda run: principal.check_project(run.project),
    )
    request.app.state.service_metrics.ingested(result.inserted, result.duplicates)
    if result.notifications:
        request.app.state.background.wake()
    return IngestPublic(inserted=result.inserted, duplicates=result.duplicates)
