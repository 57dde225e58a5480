"""The closed loop: scheduled lambdas per layer, operator overrides, and their audit trail."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, HTTPException

from qkwatch.contract import api, scheduling
from qkwatch.contract.responses import AuditListPublic, AuditPublic, LambdasPublic
from qkwatch.contract.wire import OverridesPut, layer_key
from qkwatch.monitor.api.deps import Controller, Reader, StoreDep, load_run
from qkwatch.monitor.api.run_ref import RunRef, StrictRunRefRoute
from qkwatch.monitor.store.models import RunRow
from qkwatch.monitor.store.runs.lambdas import LambdaState
from qkwatch.monitor.store.store import Invalid, NotFound

router = APIRouter(tags=["lambdas"], route_class=StrictRunRefRoute)


def lambdas_public(run: RunRow, state: LambdaState) -> LambdasPublic:
    """lambda_l = lambda_0 * sigmoid((H_l - H*) / beta) per layer (0 before any entropy), then overrides.

    Nothing above the run's ``lambda_max`` is served: the store clips overrides when a config
    lowers it, and this clips again, so that no path can hand the trainer a value it must refuse.
    """
    cfg = run.config.schedule
    assert cfg.lambda_max is not None  # ScheduleConfig.__post_init__ resolves it
    n = state.n_layers or 0
    h = [state.h.get(layer) for layer in range(n)]
    overrides = {layer: min(value, cfg.lambda_max) for layer, value in sorted(state.overrides.items())}
    lambdas = scheduling.apply_overrides(scheduling.entropy_floor(h, cfg), overrides)
    return LambdasPublic(
        version=state.version,
        step=state.step,
        lambdas=lambdas,
        overrides=overrides,
        h=h,
        schedule=dataclasses.asdict(cfg),
    )


@router.get(api.LAMBDAS, response_model=LambdasPublic)
def get_lambdas(run_id: RunRef, store: StoreDep, principal: Reader) -> LambdasPublic:
    """The weights the trainer should apply now; ``version`` changes whenever they do."""
    if "/" in run_id:  # project/name: resolved (and the project checked) first
        run_id = load_run(store, run_id, principal).id
    try:
        run, state = store.lambda_state(run_id)  # one round trip: this is on the trainer's path
    except NotFound:
        raise HTTPException(404, f"run {run_id} not found") from None
    principal.check_project(run.project)
    return lambdas_public(run, state)


@router.put(api.LAMBDA_OVERRIDES, response_model=LambdasPublic)
def put_overrides(run_id: RunRef, body: OverridesPut, store: StoreDep, principal: Controller) -> LambdasPublic:
    """Set (or with null remove) per-layer overrides; all are validated before any is applied."""
    run_id = load_run(store, run_id, principal).id
    overrides: dict[int, float | None] = {}
    for key, value in body.root.items():
        try:
            overrides[layer_key(key)] = value
        except ValueError as exc:
            raise HTTPException(422, f"overrides: {exc}") from None
    try:
        run, state = store.set_overrides(run_id, overrides, who=f"{principal.name} ({principal.id})")
    except Invalid as exc:
        raise HTTPException(422, f"overrides: {exc}") from None
    return lambdas_public(run, state)


@router.get(api.LAMBDA_AUDIT, response_model=AuditListPublic)
def get_audit(run_id: RunRef, store: StoreDep, principal: Reader) -> AuditListPublic:
    rows = store.lambda_audit(load_run(store, run_id, principal))
    return AuditListPublic(data=[AuditPublic.model_validate(r, from_attributes=True) for r in rows], count=len(rows))
