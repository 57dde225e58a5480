"""A batch of reports into the database: flattened into rows, written in one transaction.

:func:`write_batch` is the transaction's body: the batch id (exactly once), the points, frames,
events and latest values, then the run's schedule state and its alerts (decided in
:mod:`qkwatch.rules.evaluator`, written through :class:`qkwatch.monitor.store.runs.alerts.AlertRows`).

The cost of a batch is constant in the run's history: points go in with insert-or-ignore on
their natural key (an index probe each), never a read of what is already stored.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, TypeGuard

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from qkwatch.contract import api
from qkwatch.contract.values import decode_value
from qkwatch.contract.wire import ReportBatch
from qkwatch.monitor.store import models, sql
from qkwatch.monitor.store.errors import Invalid
from qkwatch.monitor.store.metric_names import ids_for_batch
from qkwatch.monitor.store.models import LAYER_VALUE, RUN_SCALAR
from qkwatch.monitor.store.runs import alerts, events, lambdas, lookup
from qkwatch.monitor.store.runs.events import EventIn
from qkwatch.monitor.store.values import frames
from qkwatch.monitor.store.values.points import PointRow, insert_points
from qkwatch.rules.evaluator import RunEnd, evaluate_batch
from qkwatch.rules.ruleset import RuleSet

Latest = dict[tuple[str, int], tuple[int, float | None]]
"""(metric, layer) -> (step, value) of the newest layer-level value or scalar; a NaN value is None."""
LatestRow = tuple[str, list[float | None], bool]
"""(metric, decoded layer values, all finite floats) of one report, for :func:`_set_latest`."""


@dataclass(frozen=True)
class IngestResult:
    inserted: int
    duplicates: int
    replayed_batch: bool = False
    notifications: int = 0
    """Alert notifications queued by this batch (the notifier is woken when > 0)."""


@dataclass
class FlatBatch:
    """A validated batch as rows, ready to insert."""

    points: list[PointRow] = field(default_factory=list)
    frames: list[frames.FrameRow] = field(default_factory=list)
    latest: Latest = field(default_factory=dict)
    """(metric, layer) -> (step, value) of the newest layer-level value or scalar in the batch."""
    layer_values: list[tuple[int, dict[str, list[float | None]]]] = field(default_factory=list)
    """(step, metric -> decoded value per layer) per report, for the schedule and the alert rules."""
    events: list[EventIn] = field(default_factory=list)
    max_step: int = -1


def flatten(batch: ReportBatch) -> FlatBatch:
    """Decode every value and lay the batch out as point rows (nulls, "not measured", are dropped).

    A metric's row of finite floats, the usual one, is laid out with C-level ``zip`` and ``array``,
    and the batch's latest values are set from whole rows; a value at a time only in rows with a
    null, a non-finite value or an int (``tests/monitor/store/test_ingest_flatten.py`` checks that
    both ways give the same batch).
    """
    flat = FlatBatch()
    pts = flat.points
    newest: list[tuple[int, list[LatestRow], list[tuple[str, float]]]] = []
    for report in batch.reports:
        step = report.step
        flat.max_step = max(flat.max_step, step)
        decoded: dict[str, list[float | None]] = {}
        rows: list[LatestRow] = []
        for metric, values in report.layers.items():
            row: list[float | None]
            if _finite_floats(values):
                row = list(values)
                n = len(row)
                if n:
                    flat.frames.append((metric, step, f"a{n}", array("d", values).tobytes(), None, False))
                pts.extend(zip(repeat(metric), repeat(LAYER_VALUE), range(n), repeat(step), row))
                rows.append((metric, row, True))
            else:
                row = [decode_value(v) for v in values]
                frame = frames.pack(metric, step, row)
                if frame is not None:
                    flat.frames.append(frame)
                pts.extend(
                    (metric, LAYER_VALUE, layer, step, sql.to_db(v)) for layer, v in enumerate(row) if v is not None
                )
                rows.append((metric, row, False))
            decoded[metric] = row
        for metric, per_layer in report.heads.items():
            for layer, heads in enumerate(per_layer):
                for head, raw in enumerate(heads or ()):
                    value = decode_value(raw)
                    if value is not None:
                        pts.append((metric, head, layer, step, sql.to_db(value)))
        scalars = []
        for name, raw in report.scalars.items():
            value = decode_value(raw)
            if value is not None:
                pts.append((name, RUN_SCALAR, RUN_SCALAR, step, sql.to_db(value)))
                scalars.append((name, value))
        newest.append((step, rows, scalars))
        flat.layer_values.append((step, decoded))
        flat.events += [(step, e.kind, e.message, e.data, report.time) for e in report.events]
    _set_latest(flat.latest, newest)
    return flat


def _finite_floats(values: list[Any]) -> TypeGuard[list[float]]:
    """Every value a finite float (no null, int, "nan"/"inf" string or non-finite float)."""
    return all(type(v) is float for v in values) and all(map(math.isfinite, values))


def _set_latest(latest: Latest, newest: list[tuple[int, list[LatestRow], list[tuple[str, float]]]]) -> None:
    """The newest value per (metric, layer): the reports in step order, a stable sort (of two reports
    of one step the later one wins), each overwriting what it measured. A NaN is stored as None."""
    for step, rows, scalars in sorted(newest, key=itemgetter(0)):
        for metric, row, finite in rows:
            if finite:
                latest.update(zip(zip(repeat(metric), range(len(row))), zip(repeat(step), row), strict=True))
            else:
                for layer, value in enumerate(row):
                    if value is not None:
                        latest[(metric, layer)] = (step, sql.to_db(value))
        for name, value in scalars:
            latest[(name, RUN_SCALAR)] = (step, sql.to_db(value))


def write_batch(
    conn: sa.Connection,
    run_id: str,
    batch: ReportBatch,
    flat: FlatBatch,
    rules: RuleSet,
    now: float,
    max_names: int | None = None,
    allow: Callable[[models.RunRow], None] | None = None,
) -> IngestResult:
    """Store a flattened batch whole or not at all (the caller's transaction), exactly once.

    Args:
        max_names: the most distinct metric names a run may have (None: no limit).
        allow: called with the locked run before anything is written (see ``Store.add_reports``).

    Raises:
        NotFound: unknown run.
        Invalid: the batch names an attempt the run does not have, or takes the run past ``max_names``.
    """
    total = len(flat.points)
    run = lookup.locked(conn, run_id)
    if allow is not None:
        allow(run)
    attempt = batch.attempt or run.latest_attempt
    if attempt > run.latest_attempt:
        raise Invalid(
            f"attempt: run {run.id} has no attempt {attempt} (latest is {run.latest_attempt}); "
            f"start one with POST {api.RUNS} and an attempt_key"
        )
    if not _record_batch(conn, run, str(batch.batch_id), attempt, total, now):
        return IngestResult(inserted=0, duplicates=total, replayed_batch=True)
    # The ids are read here, in this transaction, and never kept: see monitor.store.metric_names.
    ids = ids_for_batch(conn, run, metric_names(flat), max_names)
    inserted = insert_points(conn, run.pk, attempt, flat.points, ids)
    if inserted < total:
        # Some points were stored before (or come twice in this batch): the first value of a point
        # stays, and the frames, latest values, schedule and rules take what is stored, so that
        # every read path shows one value per point.
        keep_first_values(conn, run.pk, attempt, flat, ids)
    insert_frames(conn, run.pk, attempt, flat.frames, ids)
    events.insert(conn, run.pk, attempt, flat.events)
    _upsert_latest(conn, run.pk, attempt, flat.latest)
    lambda_step = lambdas.feed_schedule(conn, run, attempt, flat.layer_values)
    ledger = alerts.AlertRows(conn, run.pk, now)
    queued = evaluate_batch(rules, ledger, attempt, flat.layer_values, _run_end(run, flat.max_step, inserted))
    _touch_run(conn, run, flat.max_step, inserted, lambda_step, now)
    return IngestResult(inserted=inserted, duplicates=total - inserted, notifications=queued)


def _record_batch(
    conn: sa.Connection, run: models.RunRow, batch_id: str, attempt: int, points: int, now: float
) -> bool:
    """Record the batch id; False when the run has it already (a replay, stored before)."""
    # The batch id is the run's, whatever the attempt: a resumed process re-sending it is a replay.
    # (RETURNING, not rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT DO NOTHING.)
    stmt = _RECORD_BATCH[conn.dialect.name]
    params = {"run_pk": run.pk, "batch_id": batch_id, "attempt": attempt, "points": points, "received_at": now}
    return conn.execute(stmt, params).first() is not None


# Built once (see lookup._BY_ID): one per dialect, each ``INSERT ... ON CONFLICT DO NOTHING RETURNING``.
_RECORD_BATCH = {
    name: dialect.insert(models.batches)
    .values({c: sa.bindparam(c) for c in ("run_pk", "batch_id", "attempt", "points", "received_at")})
    .on_conflict_do_nothing()
    .returning(models.batches.c.batch_id)
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}


def _upsert_latest(conn: sa.Connection, pk: int, attempt: int, latest: Latest) -> None:
    rows = [
        {"run_pk": pk, "metric": metric, "layer": layer, "attempt": attempt, "step": step, "value": value}
        for (metric, layer), (step, value) in latest.items()
    ]
    # Only a newer (attempt, step) replaces the stored value: late batches do not.
    sql.upsert(
        conn,
        models.latest,
        rows,
        where="excluded.attempt > t.attempt OR (excluded.attempt = t.attempt AND excluded.step >= t.step)",
    )


def _run_end(run: models.RunRow, max_step: int, inserted: int) -> RunEnd | None:
    """How the run ended, when the batch reaches it ended and does not revive it (see ``_touch_run``):
    another rank's last reports, delivered after rank 0 said the run finished."""
    if run.status not in lookup.TERMINAL:
        return None
    stale = run.status == "crashed" and run.status_reason == "stale"
    if stale and inserted:
        return None
    last = max(max_step, run.last_step if run.last_step is not None else -1)
    return RunEnd(last if last >= 0 else None, "stale" if stale else run.status)


def _touch_run(
    conn: sa.Connection, run: models.RunRow, max_step: int, inserted: int, lambda_step: int | None, now: float
) -> None:
    """The run after a batch: its last report and step, a new lambda version when the schedule moved."""
    values: dict[str, Any] = {
        "last_report_at": now,
        "updated_at": now,
        "last_step": max(max_step, run.last_step if run.last_step is not None else -1),
    }
    if lambda_step is not None:
        values["lambda_version"] = run.lambda_version + 1
        values["lambda_step"] = lambda_step
    if run.status == "crashed" and run.status_reason == "stale" and inserted:
        # The heartbeat guessed wrong: the run was only quiet.
        values.update(status="running", status_reason=None)
    conn.execute(_TOUCH_RUN, {"run_pk_": run.pk, **values})


_TOUCH_RUN = sa.update(models.runs).where(models.runs.c.pk == sa.bindparam("run_pk_"))
"""The run's row updated; the columns set are the keys of the parameters (see ``_touch_run``)."""


def keep_first_values(conn: sa.Connection, run_pk: int, attempt: int, flat: FlatBatch, ids: dict[str, int]) -> None:
    """Replace the batch's layer values, frames and latest values by the points' stored values.

    Called after ``insert_points`` when some points were already stored: the point keeps its first
    value (insert-or-ignore), so whatever else the batch writes must carry that value too.
    """
    keys = {
        (ids[metric], layer, step)
        for step, decoded in flat.layer_values
        for metric, row in decoded.items()
        for layer, value in enumerate(row)
        if value is not None
    }
    keys |= {(ids[metric], layer, step) for (metric, layer), (step, _value) in flat.latest.items()}
    stored = _stored_values(conn, run_pk, attempt, sorted(keys))

    def first(metric: str, layer: int, step: int, value: float) -> float:
        found = stored.get((ids[metric], layer, step), value)
        return math.nan if found is None else found

    flat.layer_values = [
        (
            step,
            {
                metric: [None if v is None else first(metric, layer, step, v) for layer, v in enumerate(row)]
                for metric, row in decoded.items()
            },
        )
        for step, decoded in flat.layer_values
    ]
    flat.frames = [
        frame
        for step, decoded in flat.layer_values
        for metric, row in decoded.items()
        if (frame := frames.pack(metric, step, row)) is not None
    ]
    flat.latest = {
        (metric, layer): (step, sql.to_db(first(metric, layer, step, math.nan if v is None else v)))
        for (metric, layer), (step, v) in flat.latest.items()
    }


def _stored_values(
    conn: sa.Connection, run_pk: int, attempt: int, keys: list[tuple[int, int, int]]
) -> dict[tuple[int, int, int], float | None]:
    """Stored value (None: NaN) of each (metric id, layer, step) layer value or scalar of ``attempt``.

    A join with the keys as a VALUES list: one primary-key probe per key on both databases (an
    IN list of row values makes SQLite scan the run, and SQLite has no ``VALUES ... AS k (cols)``).
    The join also bounds the points to the chunk's metrics and steps: PostgreSQL, with statistics
    older than the run, can plan it as one scan of the run's whole index instead of probes (seen in
    ``bench/fleet.py`` at 256 ranks: each replayed batch read millions of points), and the bounds
    keep even that plan to the batch's own range of the key (``tests/monitor/store/test_exactly_once.py``).
    """
    out: dict[tuple[int, int, int], float | None] = {}
    for i in range(0, len(keys), 1000):  # 3,000 parameters per statement
        chunk = keys[i : i + 1000]
        rows = ", ".join(f"(:m{j}, :l{j}, :s{j})" for j in range(len(chunk)))
        metric_ids = sorted({metric_id for metric_id, _, _ in chunk})
        steps = [step for _, _, step in chunk]
        params = {"run_pk": run_pk, "head": LAYER_VALUE, "attempt": attempt, "lo": min(steps), "hi": max(steps)}
        params |= {f"id{j}": metric_id for j, metric_id in enumerate(metric_ids)}
        for j, (metric_id, layer, step) in enumerate(chunk):
            params |= {f"m{j}": metric_id, f"l{j}": layer, f"s{j}": step}
        ids = ", ".join(f":id{j}" for j in range(len(metric_ids)))
        result = conn.execute(
            sa.text(
                f"WITH k (metric_id, layer, step) AS (VALUES {rows}) "
                "SELECT k.metric_id, k.layer, k.step, p.value FROM k JOIN points p ON p.run_pk = :run_pk "
                "AND p.metric_id = k.metric_id AND p.head = :head AND p.layer = k.layer AND p.step = k.step "
                f"AND p.attempt = :attempt AND p.metric_id IN ({ids}) AND p.step BETWEEN :lo AND :hi"
            ),
            params,
        )
        out.update({(r[0], r[1], r[2]): r[3] for r in result})
    return out


def metric_names(flat: FlatBatch) -> set[str]:
    return {p[0] for p in flat.points}


def insert_frames(
    conn: sa.Connection, run_pk: int, attempt: int, rows: list[frames.FrameRow], ids: dict[str, int]
) -> None:
    """Insert-or-ignore the batch's frames (their key mirrors the points' natural key)."""
    if rows:
        sql.upsert(
            conn,
            models.frames,
            [
                {
                    "run_pk": run_pk,
                    "metric_id": ids[m],
                    "step": s,
                    "attempt": attempt,
                    "mask": k,
                    "vals": v,
                    "present": p,
                    "has_nan": n,
                }
                for (m, s, k, v, p, n) in rows
            ],
            update=False,
        )
