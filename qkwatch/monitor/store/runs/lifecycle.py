"""How a run starts, resumes, ends and goes away: attempts, statuses, tags and notes, the heartbeat, retention."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import sqlalchemy as sa

from qkwatch.contract.values import MAX_TAGS
from qkwatch.contract.wire import RunConfig, RunCreate, RunPatch
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql
from qkwatch.monitor.store.errors import Invalid
from qkwatch.monitor.store.runs import lambdas, lookup
from qkwatch.monitor.store.runs.alerts import AlertRows
from qkwatch.rules.evaluator import end_of_run

logger = logging.getLogger(__name__)


def create_or_resume(conn: sa.Connection, body: RunCreate, now: float) -> tuple[m.RunRow, int]:
    """Create the run (attempt 1) or resume it; returns the run and the attempt to report under.

    An unseen ``attempt_key`` starts attempt latest+1; a known one returns its attempt; no key
    returns the latest attempt. A finished or crashed run is set back to running, unless a
    known key re-registers an attempt whose end was already reported (see :func:`_keeps_status`).
    A config given replaces the stored one; when its ``schedule.lambda_max`` is below existing
    overrides, they are clipped (audited). An empty config keeps the stored one.

    Tags given are added to the run's (:func:`_add_tags`): a resume never takes one away, so a tag
    set through the API outlives the restart of a job that does not know it. Notes given are stored
    when the run has none; notes already set are kept, since a job's restart or a late ``qkwatch sync``
    re-sends the notes it started with and must not undo an edit (PATCH changes them).
    """
    row = lookup.locked_by_name(conn, body.project, body.name)
    if row is None:
        row = _insert_run(conn, body, now)
    known = _known_attempt(conn, row, body.attempt_key)
    attempt = known if known is not None else _resolve_attempt(conn, row, body.attempt_key, now)
    values: dict[str, Any] = {"updated_at": now, "latest_attempt": max(attempt, row.latest_attempt)}
    if not (known is not None and _keeps_status(row)):
        values.update(status="running", status_reason=None)
    _add_tags(conn, row, body.tags)
    if body.notes and not row.notes:
        values["notes"] = body.notes
    config = _keep_shape(row, body.config) if body.config.model_fields_set else None  # extras count
    if config is not None:
        values["config"] = json.dumps(config.as_dict())
    conn.execute(sa.update(m.runs).where(m.runs.c.pk == row.pk).values(**values))
    if config is not None:
        lambdas.clip_overrides(conn, lookup.by_pk(conn, row.pk), config.schedule, attempt, now)
    return lookup.by_pk(conn, row.pk), attempt


def _add_tags(conn: sa.Connection, run: m.RunRow, tags: list[str]) -> None:
    """Add the tags the run lacks, while it has fewer than :data:`MAX_TAGS`.

    A create or resume is never refused for its tags (the agent would set its reports aside with
    the refusal): on a resume that would take the run past the bound, the first new tags in sorted
    order are added, the rest left out with a warning, and the answer lists the tags the run has.
    """
    new = [t for t in tags if t not in run.tags]
    room = max(0, MAX_TAGS - len(run.tags))
    if len(new) > room:
        logger.warning(
            "run %s/%s has %d tags: %s left out (at most %d per run)",
            run.project,
            run.name,
            len(run.tags),
            ", ".join(new[room:]),
            MAX_TAGS,
        )
        new = new[:room]
    if new:
        rows = [{"run_pk": run.pk, "tag": t} for t in new]
        conn.execute(sql.insert(conn, m.run_tags).values(rows).on_conflict_do_nothing())


def patch(conn: sa.Connection, run_id: str, body: RunPatch, now: float) -> m.RunRow:
    """Apply a PATCH: the tags and notes (:func:`annotate`), then the status (:func:`set_status`).

    One transaction: an invalid part (Invalid) leaves the run as it was.
    """
    if body.status is None:
        return annotate(conn, run_id, body)
    if body.annotates():
        annotate(conn, run_id, body)
    return set_status(conn, run_id, body.status, body.reason, body.attempt, now)


def annotate(conn: sa.Connection, run_id: str, body: RunPatch) -> m.RunRow:
    """Set the run's tags (``tags``: all of them; ``add_tags``, ``remove_tags``: those) and notes.

    Tags and notes say what a run is, not what it did: ``updated_at`` (its latest activity, which
    orders the lists and starts the retention clock) does not move.

    Raises:
        NotFound: unknown run. Invalid: more than :data:`MAX_TAGS` tags would result (naming ``add_tags``).
    """
    run = lookup.locked(conn, run_id)
    have = set(run.tags)
    want = set(body.tags) if body.tags is not None else (have | set(body.add_tags or ())) - set(body.remove_tags or ())
    if len(want) > MAX_TAGS and len(want) > len(have):  # only add_tags can (the schema bounds ``tags``)
        raise Invalid(
            f"add_tags: run {run.project}/{run.name} would have {len(want)} tags; a run has at most {MAX_TAGS} "
            "(remove some with remove_tags)"
        )
    t = m.run_tags
    if have - want:
        conn.execute(sa.delete(t).where(t.c.run_pk == run.pk, t.c.tag.in_(sorted(have - want))))
    if want - have:
        conn.execute(sa.insert(t).values([{"run_pk": run.pk, "tag": tag} for tag in sorted(want - have)]))
    if "notes" in body.model_fields_set:
        conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk).values(notes=body.notes or None))
    return lookup.by_pk(conn, run.pk)


def _keep_shape(run: m.RunRow, config: RunConfig) -> RunConfig:
    """The config to store on a resume: its layer count may not change (Invalid), and one left out is kept.

    The layer count sizes the lambdas the trainer reads and the alerts' layers; a resume that
    changed it would silently change what they mean. A count stored before it was bounded
    (set aside when the row is read: :func:`qkwatch.monitor.store.runs.lookup.load_config`) does not
    hold the run to it.
    """
    old, new = run.config.n_layers, config.n_layers
    if old is None:
        return config
    if new is None:
        return config.model_copy(update={"n_layers": old})
    if new != old:
        raise Invalid(
            f"config.n_layers: run {run.project}/{run.name} has {old} layers, and a resume may not "
            f"change that (got {new}); start a new run for a model of another shape"
        )
    return config


def _keeps_status(run: m.RunRow) -> bool:
    """A run the agent ended (PATCH) stays ended when one of that attempt's processes registers again.

    Another rank's sender, or ``qkwatch sync`` delivering a spool, creates the run again with
    the attempt key it already has; that must not undo the status. A stale guess
    (crashed, reason "stale") does not count: the run revives as on reports.
    """
    return run.status in lookup.TERMINAL and run.status_reason != "stale"


def _known_attempt(conn: sa.Connection, run: m.RunRow, key: str | None) -> int | None:
    if key is None:
        return None
    return conn.execute(
        sa.select(m.attempts.c.attempt).where(m.attempts.c.run_pk == run.pk, m.attempts.c.attempt_key == key)
    ).scalar()


def _insert_run(conn: sa.Connection, body: RunCreate, now: float) -> m.RunRow:
    ins = sql.insert(conn, m.runs).values(
        id=uuid.uuid4().hex,
        project=body.project,
        name=body.name,
        status="running",
        config=json.dumps(body.config.as_dict()),
        created_at=now,
        updated_at=now,
        latest_attempt=1,
        lambda_version=0,
        notes=body.notes or None,
    )
    # Two replicas creating the same run at once: the loser's insert does nothing and it
    # reads (and locks) the winner's row.
    conn.execute(ins.on_conflict_do_nothing(index_elements=["project", "name"]))
    row = lookup.locked_by_name(conn, body.project, body.name)
    assert row is not None
    conn.execute(
        sql.insert(conn, m.attempts)
        .values(run_pk=row.pk, attempt=1, attempt_key=body.attempt_key, created_at=now)
        .on_conflict_do_nothing()
    )
    return row


def _resolve_attempt(conn: sa.Connection, run: m.RunRow, key: str | None, now: float) -> int:
    """No key: the latest attempt; a key not seen before: a new attempt, latest+1."""
    if key is None:
        return run.latest_attempt
    attempt = run.latest_attempt + 1
    conn.execute(sa.insert(m.attempts).values(run_pk=run.pk, attempt=attempt, attempt_key=key, created_at=now))
    return attempt


def set_status(
    conn: sa.Connection, run_id: str, status: str, reason: str | None, attempt: int | None, now: float
) -> m.RunRow:
    """Set how the run ended (idempotent); ``reason`` defaults to "patch".

    A status for an ``attempt`` older than the run's latest is ignored: it is an earlier
    process's end, delivered late, and the run has been resumed since.

    Raises:
        NotFound: unknown run. Invalid: an attempt the run does not have.
    """
    run = lookup.locked(conn, run_id)
    if attempt is not None and attempt > run.latest_attempt:
        raise Invalid(f"attempt: run {run.id} has no attempt {attempt} (latest is {run.latest_attempt})")
    if attempt is not None and attempt < run.latest_attempt:
        logger.info(
            "run %s: ignoring status %s of attempt %d (latest is %d)", run.id, status, attempt, run.latest_attempt
        )
        return run
    conn.execute(
        sa.update(m.runs)
        .where(m.runs.c.pk == run.pk)
        .values(status=status, status_reason=reason or "patch", updated_at=now)
    )
    if status in lookup.TERMINAL:
        end_of_run(AlertRows(conn, run.pk, now), run.last_step, _how(status, reason))
    return lookup.by_pk(conn, run.pk)


def _how(status: str, reason: str | None) -> str:
    """How a run ended, as its alerts keep it: "finished", "crashed", or "stale" (crashed as stale)."""
    return "stale" if status == "crashed" and reason == "stale" else status


def delete(conn: sa.Connection, pk: int) -> None:
    """Delete the run and every row of it (points, frames, alerts and their notifications...).

    The run's row is locked first, as every write of a run locks it first (ingest, status, tags,
    overrides, create or resume: :func:`qkwatch.monitor.store.runs.lookup.locked`). One order, run before
    its rows, so a delete waits for a batch being stored and then deletes that batch too, and a
    batch that waited for the delete finds no run (NotFound, a 404): never a deadlock, and no row
    written between the delete's statements is left behind. A run deleted meanwhile is no error.
    """
    if conn.execute(sa.select(m.runs.c.pk).where(m.runs.c.pk == pk).with_for_update()).first() is None:
        return
    n = m.notifications
    alert_ids = sa.select(m.alerts.c.id).where(m.alerts.c.run_pk == pk).scalar_subquery()
    # Notifications in id order, the order in which the notifier claims them (alerts.claim_notifications).
    conn.execute(sa.select(n.c.id).where(n.c.alert_id.in_(alert_ids)).order_by(n.c.id).with_for_update()).all()
    conn.execute(sa.delete(n).where(n.c.alert_id.in_(alert_ids)))
    for table in (
        m.points,
        m.frames,
        m.latest,
        m.events,
        m.batches,
        m.attempts,
        m.lambda_state,
        m.lambda_overrides,
        m.lambda_audit,
        m.alert_state,
        m.alerts,
        m.run_tags,
        m.run_metrics,
    ):
        conn.execute(sa.delete(table).where(table.c.run_pk == pk))
    conn.execute(sa.delete(m.runs).where(m.runs.c.pk == pk))


def mark_stale(conn: sa.Connection, timeout_s: float, now: float) -> list[str]:
    """Mark running runs without reports (or updates) for ``timeout_s`` as crashed; returns their ids.

    The runs are locked first, in ``pk`` order (as :func:`apply_retention` does, so two replicas'
    heartbeats take them in one order), and the condition holds under the lock: PostgreSQL checks
    it again on a row that a batch in flight changed, so a run whose report was being stored while
    the heartbeat looked is not marked (nor its alerts ended).
    """
    last = sa.func.coalesce(m.runs.c.last_report_at, m.runs.c.updated_at)
    rows = conn.execute(
        sa.select(m.runs.c.pk, m.runs.c.id, m.runs.c.last_step)
        .where(m.runs.c.status == "running", last < now - timeout_s)
        .order_by(m.runs.c.pk)
        .with_for_update()
    ).all()
    if rows:
        conn.execute(
            sa.update(m.runs)
            .where(m.runs.c.pk.in_([r.pk for r in rows]))
            .values(status="crashed", status_reason="stale", updated_at=now)
        )
        for r in rows:
            end_of_run(AlertRows(conn, r.pk, now), r.last_step, "stale")
    return [r.id for r in rows]


def apply_retention(conn: sa.Connection, days: float, now: float) -> list[str]:
    """Delete finished and crashed runs not updated for ``days``; returns their ids.

    Locked first, in ``pk`` order, with the condition held under the lock: a run resumed while
    retention looked (running again, updated now) is kept.
    """
    rows = conn.execute(
        sa.select(m.runs.c.pk, m.runs.c.id)
        .where(m.runs.c.status.in_(lookup.TERMINAL), m.runs.c.updated_at < now - days * 86400)
        .order_by(m.runs.c.pk)
        .with_for_update()
    ).all()
    for r in rows:
        delete(conn, r.pk)
    return [r.id for r in rows]
