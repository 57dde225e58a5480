"""Alerts raised by the step-based rules: ``GET /v1/alerts?run=&state=``."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from qkwatch.contract import api
from qkwatch.contract.responses import AlertsPublic
from qkwatch.monitor.api.deps import Reader, StoreDep, load_run

router = APIRouter(tags=["alerts"])


@router.get(api.ALERTS, response_model=AlertsPublic)
def list_alerts(
    store: StoreDep,
    principal: Reader,
    run: Annotated[str | None, Query(description="Only this run: its id or project/name")] = None,
    state: Annotated[
        Literal["firing", "resolved", "ended"] | None,
        Query(description="firing; resolved; ended: its run ended (finished, crashed or stale) while it fired"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> AlertsPublic:
    """Alerts visible to the caller, newest first; each has its rule, layers, onset and resolution step.

    An alert still firing when its run ended is ``ended``, never ``resolved``: it keeps the run's
    last step (``ended_step``), how it ended (``run_end``) and its metric's last values (``last_values``).
    """
    run_id = load_run(store, run, principal).id if run is not None else None
    rows = store.list_alerts(projects=principal.projects(), run_id=run_id, state=state, limit=limit)
    return AlertsPublic(data=rows, count=len(rows))
