"""The RAA lambdas of a run: running entropies fed on ingest, operator overrides, their audit trail.

The schedule's formula and its EMA are :mod:`qkwatch.contract.scheduling`'s; this module keeps their state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from qkwatch.contract import scheduling
from qkwatch.contract.values import MAX_LAYERS
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql
from qkwatch.monitor.store.errors import Invalid
from qkwatch.monitor.store.runs import events, lookup

logger = logging.getLogger(__name__)

CLIP_WHO = "collector: lambda_max of the run's config"
"""The audit trail's ``who`` of an override clipped because the run's config lowered lambda_max."""

Change = tuple[int, float | None, float | None]
"""(layer, old override, new override); None: no override."""


@dataclass(frozen=True)
class LambdaState:
    version: int
    step: int | None
    n_layers: int | None
    h: dict[int, float | None]
    overrides: dict[int, float]


@dataclass(frozen=True)
class AuditRow:
    layer: int
    old: float | None
    new: float | None
    who: str
    at: float
    step: int | None
    version: int


# --- running entropies (the schedule's input) -------------------------------------------------


@dataclass(frozen=True)
class Entropy:
    """A layer's running normalised entropy (NaN: no finite value yet) and the report that last moved it."""

    h: float
    attempt: int
    step: int


def advance_entropies(
    state: Mapping[int, Entropy],
    attempt: int,
    reports: Iterable[tuple[int, list[float | None]]],
    cfg: scheduling.ScheduleConfig,
) -> dict[int, Entropy]:
    """The layers whose running entropy the reports move, with their new value (pure).

    Args:
        state: layer -> running entropy as stored.
        attempt: the attempt of every report.
        reports: (step, entropy per layer, None where not measured) in step order.
        cfg: the run's schedule.

    A value at or before the (attempt, step) that last fed its layer (a late or replayed report)
    does not move it: the running value follows the run forward in (attempt, step) order.
    """
    changed: dict[int, Entropy] = {}
    for step, values in reports:
        for layer, value in enumerate(values):
            if value is None:
                continue
            cur = changed.get(layer) or state.get(layer)
            if cur is not None and (attempt, step) <= (cur.attempt, cur.step):
                continue
            changed[layer] = Entropy(scheduling.ema_update(None if cur is None else cur.h, value, cfg), attempt, step)
    return changed


_ENTROPIES = sa.select(m.lambda_state).where(m.lambda_state.c.run_pk == sa.bindparam("run_pk"))
"""A run's running entropies (built once: it runs in every ingest)."""


def feed_schedule(
    conn: sa.Connection,
    run: m.RunRow,
    attempt: int,
    layer_values: Sequence[tuple[int, Mapping[str, list[float | None]]]],
) -> int | None:
    """EMA-update the run's running entropies with a batch's ``attn_entropy`` values.

    Returns the step of the newest entropy that moved them, or None when nothing moved.
    """
    reports = sorted((s, v["attn_entropy"]) for s, v in layer_values if "attn_entropy" in v)
    if not reports:
        return None
    cfg = run.config.schedule
    ls = m.lambda_state
    state = {
        r.layer: Entropy(sql.from_db(r.h), r.attempt, r.step) for r in conn.execute(_ENTROPIES, {"run_pk": run.pk})
    }
    changed = advance_entropies(state, attempt, reports, cfg)
    if not changed:
        return None
    sql.upsert(
        conn,
        ls,
        [
            {"run_pk": run.pk, "layer": layer, "h": sql.to_db(e.h), "attempt": e.attempt, "step": e.step}
            for layer, e in changed.items()
        ],
    )
    return max(e.step for e in changed.values())


# --- what GET /lambdas serves -----------------------------------------------------------------


def state(conn: sa.Connection, run: m.RunRow) -> LambdaState:
    """The running entropies and the overrides of the run."""
    # One round trip for both (GET /lambdas is on the trainer's path).
    ls, lo = m.lambda_state, m.lambda_overrides
    rows = conn.execute(
        sa.union_all(
            sa.select(sa.literal(0).label("kind"), ls.c.layer, ls.c.h.label("v")).where(ls.c.run_pk == run.pk),
            sa.select(sa.literal(1).label("kind"), lo.c.layer, lo.c.value.label("v")).where(lo.c.run_pk == run.pk),
        )
    ).all()
    h = {r.layer: r.v for r in rows if r.kind == 0}
    ov = {r.layer: r.v for r in rows if r.kind == 1}
    n = run.config.n_layers
    n_layers = n if n is not None else (min(max(h) + 1, MAX_LAYERS) if h else None)
    return LambdaState(version=run.lambda_version, step=run.lambda_step, n_layers=n_layers, h=h, overrides=ov)


# --- overrides ----------------------------------------------------------------------------------


def set_overrides(
    conn: sa.Connection, run_id: str, overrides: dict[int, float | None], who: str, now: float
) -> tuple[m.RunRow, LambdaState]:
    """Validate every override against the run's schedule, then apply the ones that change (audited).

    Raises:
        NotFound: unknown run. Invalid: naming the layer and the bound; nothing is applied then.
    """
    run = lookup.locked(conn, run_id)
    current = state(conn, run)
    cfg = run.config.schedule
    for layer, value in overrides.items():
        try:
            scheduling.check_override(layer, 0.0 if value is None else value, cfg, current.n_layers)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
    changes = [
        (la, current.overrides.get(la), v) for la, v in sorted(overrides.items()) if current.overrides.get(la) != v
    ]
    if changes:
        _write_overrides(conn, run, changes, current.step, run.lambda_version + 1, who, now)
    run = lookup.by_pk(conn, run.pk)
    return run, state(conn, run)


def clip_overrides(
    conn: sa.Connection, run: m.RunRow, cfg: scheduling.ScheduleConfig, attempt: int, now: float
) -> None:
    """Clip overrides above the (new) config's ``lambda_max``: audited, and an event on the run.

    An operator may set overrides before the trainer sends its config, or a resume may lower
    ``lambda_max``; the trainer refuses values above its bound, so they are clipped here
    rather than lost there.
    """
    o = m.lambda_overrides
    rows = conn.execute(
        sa.select(o.c.layer, o.c.value).where(o.c.run_pk == run.pk, o.c.value > cfg.lambda_max).order_by(o.c.layer)
    ).all()
    if not rows:
        return
    changes = [(r.layer, r.value, cfg.lambda_max) for r in rows]
    _write_overrides(conn, run, changes, run.lambda_step, run.lambda_version + 1, CLIP_WHO, now)
    clipped = [{"layer": layer, "requested": old, "applied": new} for layer, old, new in changes]
    message = (
        f"overrides of layers {[c['layer'] for c in clipped]} clipped to the run config's lambda_max={cfg.lambda_max}"
    )
    logger.info("run %s: %s", run.id, message)
    events.insert(
        conn,
        run.pk,
        attempt,
        [
            (
                max(run.last_step or 0, 0),
                "overrides_clipped",
                message,
                {"layers": clipped, "lambda_max": cfg.lambda_max},
                now,
            )
        ],
    )


def _write_overrides(
    conn: sa.Connection, run: m.RunRow, changes: list[Change], step: int | None, version: int, who: str, now: float
) -> None:
    o = m.lambda_overrides
    for layer, _old, new in changes:
        conn.execute(sa.delete(o).where(o.c.run_pk == run.pk, o.c.layer == layer))
        if new is not None:
            conn.execute(sa.insert(o).values(run_pk=run.pk, layer=layer, value=new))
    conn.execute(
        sa.insert(m.lambda_audit),
        [
            {
                "run_pk": run.pk,
                "layer": layer,
                "old": old,
                "new": new,
                "who": who,
                "at": now,
                "step": step,
                "version": version,
            }
            for layer, old, new in changes
        ],
    )
    conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk).values(lambda_version=version, updated_at=now))


def audit(conn: sa.Connection, run: m.RunRow) -> list[AuditRow]:
    """Every override change of the run, oldest first."""
    a = m.lambda_audit
    rows = conn.execute(sa.select(a).where(a.c.run_pk == run.pk).order_by(a.c.id)).all()
    return [AuditRow(r.layer, r.old, r.new, r.who, r.at, r.step, r.version) for r in rows]
