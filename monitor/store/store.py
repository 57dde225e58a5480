"""The store: the only code that knows SQL. Batch-first; every method is one transaction.

Errors the API turns into 4xx are raised as :class:`NotFound` and :class:`Invalid`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
import uuid
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import sqlalchemy as sa
from alembic.migration import MigrationContext
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine

from monitor import scheduling
from monitor.alerting.rules import LayerState, ReportValues, RuleSet, Transition, evaluate
from monitor.store import frames, ingest
from monitor.store import models as m
from monitor.store.engine import is_postgres
from monitor.wire import MAX_LAYERS, ReportBatch, RunCreate, clip_depth

logger = logging.getLogger(__name__)

TERMINAL = ("finished", "crashed")
CLIP_WHO = "collector: lambda_max of the run's config"
"""The audit trail's ``who`` of an override clipped because the run's config lowered lambda_max."""


class NotFound(LookupError):
    """The run (or other object) does not exist."""


class Invalid(ValueError):
    """The request is well-formed but not acceptable; the message names the problem."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _insert(conn: sa.Connection, table: sa.Table):
    return (postgresql.insert if is_postgres(conn) else sqlite.insert)(table)


def _run_row(r: sa.Row) -> m.RunRow:
    # clip_depth: a config stored before its depth was bounded is read back cut at the bound.
    return m.RunRow(pk=r.pk, id=r.id, project=r.project, name=r.name, status=r.status,
                    status_reason=r.status_reason, config=clip_depth(json.loads(r.config)), created_at=r.created_at,
                    updated_at=r.updated_at, last_report_at=r.last_report_at, last_step=r.last_step,
                    latest_attempt=r.latest_attempt, lambda_version=r.lambda_version, lambda_step=r.lambda_step)


def _layer_count(config: dict[str, Any]) -> int | None:
    """``config["n_layers"]`` when it is a layer count the collector accepts, else None (unknown)."""
    n = config.get("n_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_LAYERS else None


def _nan(value: float | None) -> float:
    """Stored NULL (a NaN point) back to NaN."""
    return math.nan if value is None else value


class Store:
    """All database access of the collector."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._closed = False
        self._metric_ids: dict[str, int] = {}

    def close(self) -> None:
        """Dispose of the connection pool; idempotent."""
        if not self._closed:
            self._closed = True
            self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        with self.engine.connect().execution_options(write=True) as conn, conn.begin():
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def ping(self) -> None:
        with self._read() as conn:
            conn.execute(sa.text("SELECT 1"))

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at; None when it has none (an empty database)."""
        with self._read() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    # --- rate limit -------------------------------------------------------------------------

    def take_tokens(self, key: str, want: int, rate: float, burst: int, now: float | None = None) -> tuple[int, float]:
        """Take up to ``want`` tokens from the bucket ``key`` (``burst`` at most, refilled at ``rate`` per second).

        The bucket is a row, so every worker and replica on the database draws from the same one.
        Returns (tokens taken, seconds until one is available): (0, wait) when none is.
        """
        now = time.time() if now is None else now
        b = m.rate_buckets
        with self._write() as conn:
            if is_postgres(conn):  # a lost bucket update after a crash costs nothing worth an fsync
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
            conn.execute(_insert(conn, b).values(key=key, tokens=float(burst), updated_at=now)
                         .on_conflict_do_nothing())
            row = conn.execute(sa.select(b.c.tokens, b.c.updated_at).where(b.c.key == key).with_for_update()).one()
            # Clocks of replicas differ a little: time never runs backwards for a bucket.
            tokens = min(float(burst), row.tokens + max(0.0, now - row.updated_at) * rate)
            taken = min(want, int(tokens)) if tokens >= 1 else 0
            conn.execute(sa.update(b).where(b.c.key == key).values(tokens=tokens - taken,
                                                                   updated_at=max(now, row.updated_at)))
        return taken, 0.0 if taken else (1 - tokens) / rate

    # --- runs -------------------------------------------------------------------------------

    def create_or_resume_run(self, body: RunCreate, now: float | None = None) -> tuple[m.RunRow, int]:
        """Create the run (attempt 1) or resume it; returns the run and the attempt to report under.

        An unseen ``attempt_key`` starts attempt latest+1; a known one returns its attempt; no key
        returns the latest attempt. A finished or crashed run is set back to running, unless a
        known key re-registers an attempt whose end was already reported (see :meth:`_keeps_status`).
        A new config whose ``lambda_max`` is below existing overrides clips them (audited).
        """
        now = time.time() if now is None else now
        schedule = self._check_schedule(body.config)
        with self._write() as conn:
            row = self._lock_run_by_name(conn, body.project, body.name)
            if row is None:
                row = self._insert_run(conn, body, now)
            known = self._known_attempt(conn, row, body.attempt_key)
            attempt = known if known is not None else self._resolve_attempt(conn, row, body.attempt_key, now)
            values: dict[str, Any] = {"updated_at": now, "latest_attempt": max(attempt, row.latest_attempt)}
            if not (known is not None and self._keeps_status(row)):
                values.update(status="running", status_reason=None)
            config = self._keep_shape(row, body.config) if body.config else None
            if config:
                values["config"] = json.dumps(config)
            conn.execute(sa.update(m.runs).where(m.runs.c.pk == row.pk).values(**values))
            if body.config:
                self._clip_overrides(conn, self._get(conn, m.runs.c.pk == row.pk), schedule, attempt, now)
            return self._get(conn, m.runs.c.pk == row.pk), attempt

    @staticmethod
    def _keep_shape(run: m.RunRow, config: dict[str, Any]) -> dict[str, Any]:
        """The config to store on a resume: its layer count may not change (Invalid), and one left out is kept.

        The layer count sizes the lambdas the trainer reads and the alerts' layers; a resume that
        changed it would silently change what they mean. A count stored before it was bounded
        (more than MAX_LAYERS) does not hold the run to it.
        """
        old, new = _layer_count(run.config), config.get("n_layers")
        if old is None:
            return config
        if new is None:
            return {**config, "n_layers": old}
        if new != old:
            raise Invalid(f"config.n_layers: run {run.project}/{run.name} has {old} layers, and a resume may not "
                          f"change that (got {new}); start a new run for a model of another shape")
        return config

    @staticmethod
    def _check_schedule(config: dict[str, Any]) -> scheduling.ScheduleConfig:
        try:
            return scheduling.ScheduleConfig.from_mapping(config.get("schedule"))
        except (ValueError, TypeError) as exc:
            raise Invalid(f"config.{exc}" if str(exc).startswith("schedule") else f"config.schedule: {exc}") from None

    @staticmethod
    def _keeps_status(run: m.RunRow) -> bool:
        """A run the agent ended (PATCH) stays ended when one of that attempt's processes registers again.

        Another rank's sender, or ``qkwatch sync`` delivering a spool, creates the run again with
        the attempt key it already has; that must not undo the status. A stale guess
        (crashed, reason "stale") does not count: the run revives as on reports.
        """
        return run.status in TERMINAL and run.status_reason != "stale"

    def _known_attempt(self, conn: sa.Connection, run: m.RunRow, key: str | None) -> int | None:
        if key is None:
            return None
        return conn.execute(sa.select(m.attempts.c.attempt).where(
            m.attempts.c.run_pk == run.pk, m.attempts.c.attempt_key == key)).scalar()

    def _lock_run_by_name(self, conn: sa.Connection, project: str, name: str) -> m.RunRow | None:
        q = sa.select(m.runs).where(m.runs.c.project == project, m.runs.c.name == name)
        r = conn.execute(q.with_for_update()).first()
        return _run_row(r) if r else None

    def _insert_run(self, conn: sa.Connection, body: RunCreate, now: float) -> m.RunRow:
        ins = _insert(conn, m.runs).values(
            id=uuid.uuid4().hex, project=body.project, name=body.name, status="running", config=json.dumps(body.config),
            created_at=now, updated_at=now, latest_attempt=1, lambda_version=0)
        # Two replicas creating the same run at once: the loser's insert does nothing and it
        # reads (and locks) the winner's row.
        conn.execute(ins.on_conflict_do_nothing(index_elements=["project", "name"]))
        row = self._lock_run_by_name(conn, body.project, body.name)
        assert row is not None
        conn.execute(_insert(conn, m.attempts).values(run_pk=row.pk, attempt=1, attempt_key=body.attempt_key,
                                                      created_at=now).on_conflict_do_nothing())
        return row

    def _resolve_attempt(self, conn: sa.Connection, run: m.RunRow, key: str | None, now: float) -> int:
        """No key: the latest attempt; a key not seen before: a new attempt, latest+1."""
        if key is None:
            return run.latest_attempt
        attempt = run.latest_attempt + 1
        conn.execute(sa.insert(m.attempts).values(run_pk=run.pk, attempt=attempt, attempt_key=key, created_at=now))
        return attempt

    def _get(self, conn: sa.Connection, where: sa.ColumnElement[bool]) -> m.RunRow:
        r = conn.execute(sa.select(m.runs).where(where)).first()
        if r is None:
            raise NotFound("run not found")
        return _run_row(r)

    def get_run(self, run_id: str) -> m.RunRow:
        with self._read() as conn:
            return self._get(conn, m.runs.c.id == run_id)

    def list_runs(self, *, projects: Sequence[str] | None, status: str | None = None, name: str | None = None,
                  limit: int = 100, offset: int = 0) -> tuple[list[m.RunRow], int]:
        """Runs matching the filters (``projects`` None = all), newest activity first, and their count."""
        where = []
        if projects is not None:
            where.append(m.runs.c.project.in_(list(projects)))
        if status:
            where.append(m.runs.c.status == status)
        if name:
            where.append(m.runs.c.name == name)
        with self._read() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(m.runs).where(*where)).scalar()
            rows = conn.execute(sa.select(m.runs).where(*where).order_by(m.runs.c.updated_at.desc(), m.runs.c.pk.desc())
                                .limit(limit).offset(offset)).all()
        return [_run_row(r) for r in rows], int(count or 0)

    def set_status(self, run_id: str, status: str, reason: str | None = None, attempt: int | None = None,
                   now: float | None = None) -> m.RunRow:
        """Set how the run ended (idempotent); ``reason`` defaults to "patch".

        A status for an ``attempt`` older than the run's latest is ignored: it is an earlier
        process's end, delivered late, and the run has been resumed since.

        Raises:
            NotFound: unknown run. Invalid: an attempt the run does not have.
        """
        now = time.time() if now is None else now
        with self._write() as conn:
            run = _run_row(self._locked(conn, run_id))
            if attempt is not None and attempt > run.latest_attempt:
                raise Invalid(f"attempt: run {run.id} has no attempt {attempt} (latest is {run.latest_attempt})")
            if attempt is not None and attempt < run.latest_attempt:
                logger.info("run %s: ignoring status %s of attempt %d (latest is %d)", run.id, status, attempt,
                            run.latest_attempt)
                return run
            conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk)
                         .values(status=status, status_reason=reason or "patch", updated_at=now))
            return self._get(conn, m.runs.c.pk == run.pk)

    def delete_run(self, run_id: str) -> None:
        with self._write() as conn:
            run = self._get(conn, m.runs.c.id == run_id)
            self._delete_run_rows(conn, run.pk)

    def _delete_run_rows(self, conn: sa.Connection, pk: int) -> None:
        alert_ids = sa.select(m.alerts.c.id).where(m.alerts.c.run_pk == pk).scalar_subquery()
        conn.execute(sa.delete(m.notifications).where(m.notifications.c.alert_id.in_(alert_ids)))
        for table in (m.points, m.frames, m.latest, m.events, m.batches, m.attempts, m.lambda_state, m.lambda_overrides,
                      m.lambda_audit, m.alert_state, m.alerts):
            conn.execute(sa.delete(table).where(table.c.run_pk == pk))
        conn.execute(sa.delete(m.runs).where(m.runs.c.pk == pk))

    def mark_stale(self, timeout_s: float, now: float | None = None) -> list[str]:
        """Mark running runs without reports (or updates) for ``timeout_s`` as crashed; returns their ids."""
        now = time.time() if now is None else now
        last = sa.func.coalesce(m.runs.c.last_report_at, m.runs.c.updated_at)
        with self._write() as conn:
            ids = conn.execute(sa.select(m.runs.c.id).where(m.runs.c.status == "running", last < now - timeout_s)
                               ).scalars().all()
            if ids:
                conn.execute(sa.update(m.runs).where(m.runs.c.id.in_(ids))
                             .values(status="crashed", status_reason="stale", updated_at=now))
        return list(ids)

    def apply_retention(self, days: float, now: float | None = None) -> list[str]:
        """Delete finished and crashed runs not updated for ``days``; returns their ids."""
        now = time.time() if now is None else now
        with self._write() as conn:
            rows = conn.execute(sa.select(m.runs.c.pk, m.runs.c.id).where(
                m.runs.c.status.in_(TERMINAL), m.runs.c.updated_at < now - days * 86400)).all()
            for r in rows:
                self._delete_run_rows(conn, r.pk)
        return [r.id for r in rows]

    # --- ingest -----------------------------------------------------------------------------

    def add_reports(self, run_id: str, batch: ReportBatch, rules: RuleSet, now: float | None = None) -> m.IngestResult:
        """Store a batch whole or not at all, exactly once (batch id + natural key of each point).

        Raises:
            NotFound: unknown run.
            Invalid: the batch names an attempt the run does not have.
        """
        now = time.time() if now is None else now
        flat = ingest.flatten(batch)
        total = len(flat.points)
        ids = self.metric_ids(ingest.metric_names(flat))
        with self._write() as conn:
            run = _run_row(self._locked(conn, run_id))
            attempt = batch.attempt or run.latest_attempt
            if attempt > run.latest_attempt:
                raise Invalid(f"attempt: run {run.id} has no attempt {attempt} (latest is {run.latest_attempt}); "
                              "start one with POST /v1/runs and an attempt_key")
            # The batch id is the run's, whatever the attempt: a resumed process re-sending it is a replay.
            # (RETURNING, not rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT DO NOTHING.)
            new_batch = conn.execute(_insert(conn, m.batches).values(
                run_pk=run.pk, batch_id=str(batch.batch_id), attempt=attempt, points=total, received_at=now,
            ).on_conflict_do_nothing().returning(m.batches.c.batch_id)).first()
            if new_batch is None:
                return m.IngestResult(inserted=0, duplicates=total, replayed_batch=True)
            inserted = ingest.insert_points(conn, run.pk, attempt, flat.points, ids)
            if inserted < total:
                # Some points were stored before (or come twice in this batch): the first value of a point
                # stays, and the frames, latest values, schedule and rules take what is stored, so that
                # every read path shows one value per point.
                ingest.keep_first_values(conn, run.pk, attempt, flat, ids)
            ingest.insert_frames(conn, run.pk, attempt, flat.frames, ids)
            self._insert_events(conn, run.pk, attempt, flat.events)
            self._upsert_latest(conn, run.pk, attempt, flat.latest)
            lambda_changed_step = self._feed_schedule(conn, run, attempt, flat)
            queued = self._evaluate_alerts(conn, run, attempt, flat, rules, now)
            self._touch_after_ingest(conn, run, flat.max_step, inserted, lambda_changed_step, now)
        return m.IngestResult(inserted=inserted, duplicates=total - inserted, notifications=queued)

    def metric_ids(self, names: set[str]) -> dict[str, int]:
        """Ids of metric names, registering new ones in a transaction of their own.

        Committed before the batch's transaction, so an id in the cache always exists in the
        database even when that batch rolls back (an unused name is harmless).
        """
        missing = sorted(names - self._metric_ids.keys())
        if missing:
            t = m.metric_names
            with self._write() as conn:
                conn.execute(_insert(conn, t).on_conflict_do_nothing(), [{"name": n} for n in missing])
                rows = conn.execute(sa.select(t.c.id, t.c.name).where(t.c.name.in_(missing))).all()
            self._metric_ids.update({r.name: r.id for r in rows})
        return {n: self._metric_ids[n] for n in names}

    def _metric_id(self, conn: sa.Connection, name: str) -> int | None:
        """The id of a metric name for a read; None when no run ever reported it."""
        if name not in self._metric_ids:
            found = conn.execute(sa.select(m.metric_names.c.id).where(m.metric_names.c.name == name)).scalar()
            if found is None:
                return None
            self._metric_ids[name] = found
        return self._metric_ids[name]

    def _locked(self, conn: sa.Connection, run_id: str) -> sa.Row:
        # FOR UPDATE serialises batches of one run across replicas on PostgreSQL (the schedule
        # and the alert streaks are read-modify-write); SQLite's BEGIN IMMEDIATE already does.
        r = conn.execute(sa.select(m.runs).where(m.runs.c.id == run_id).with_for_update()).first()
        if r is None:
            raise NotFound(f"run {run_id} not found")
        return r

    def _insert_events(self, conn: sa.Connection, pk: int, attempt: int, evs: list) -> None:
        if evs:
            conn.execute(_insert(conn, m.events).on_conflict_do_nothing(), [
                {"run_pk": pk, "attempt": attempt, "step": s, "kind": k, "message": msg, "data": json.dumps(d),
                 "time": t} for (s, k, msg, d, t) in evs])

    def _upsert_latest(self, conn: sa.Connection, pk: int, attempt: int, latest: dict) -> None:
        rows = [{"run_pk": pk, "metric": metric, "layer": layer, "attempt": attempt, "step": step, "value": value}
                for (metric, layer), (step, value) in latest.items()]
        # Only a newer (attempt, step) replaces the stored value: late batches do not.
        ingest.upsert(conn, m.latest, rows, where="excluded.attempt > t.attempt OR "
                                                  "(excluded.attempt = t.attempt AND excluded.step >= t.step)")

    def _feed_schedule(self, conn: sa.Connection, run: m.RunRow, attempt: int, flat: ingest.FlatBatch) -> int | None:
        """EMA-update the running entropies with the batch's newer ``attn_entropy`` values.

        Returns the step of the newest entropy that changed them, or None when nothing changed.
        Values older than what already fed a layer (late or replayed) are stored but do not move
        the running value: it follows the run forward in (attempt, step) order.
        """
        reports = sorted((s, v["attn_entropy"]) for s, v in flat.layer_values if "attn_entropy" in v)
        if not reports:
            return None
        cfg = scheduling.ScheduleConfig.from_mapping(run.config.get("schedule"))
        state = {r.layer: r for r in conn.execute(sa.select(m.lambda_state).where(m.lambda_state.c.run_pk == run.pk))}
        changed: dict[int, dict] = {}
        fed_step = None
        for step, values in reports:
            for layer, value in enumerate(values):
                if value is None:
                    continue
                cur = changed.get(layer) or (state[layer]._asdict() if layer in state else None)
                if cur is not None and (attempt, step) <= (cur["attempt"], cur["step"]):
                    continue
                prev = _nan(cur["h"]) if cur is not None else None
                h = scheduling.ema_update(prev, value, cfg)
                changed[layer] = {"run_pk": run.pk, "layer": layer, "h": None if math.isnan(h) else h,
                                  "attempt": attempt, "step": step}
                fed_step = step
        if changed:
            ingest.upsert(conn, m.lambda_state, list(changed.values()))
        return fed_step

    def _touch_after_ingest(self, conn: sa.Connection, run: m.RunRow, max_step: int, inserted: int,
                            lambda_step: int | None, now: float) -> None:
        values: dict[str, Any] = {"last_report_at": now, "updated_at": now,
                                  "last_step": max(max_step, run.last_step if run.last_step is not None else -1)}
        if lambda_step is not None:
            values["lambda_version"] = run.lambda_version + 1
            values["lambda_step"] = lambda_step
        if run.status == "crashed" and run.status_reason == "stale" and inserted:
            # The heartbeat guessed wrong: the run was only quiet.
            values.update(status="running", status_reason=None)
        conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk).values(**values))

    # --- alerts -----------------------------------------------------------------------------

    def _evaluate_alerts(self, conn: sa.Connection, run: m.RunRow, attempt: int, flat: ingest.FlatBatch,
                         rules: RuleSet, now: float) -> int:
        metrics = {r.metric for r in rules.thresholds}
        reports = [ReportValues(attempt, s, v) for s, v in flat.layer_values if metrics & v.keys()]
        if not reports:
            return 0
        rows = {(r.rule, r.layer): r for r in conn.execute(sa.select(m.alert_state).where(
            m.alert_state.c.run_pk == run.pk))}
        state = {k: LayerState(streak=r.streak, since_step=r.since_step, firing=r.alert_id is not None,
                               attempt=r.attempt, step=r.step, band_layers=tuple(json.loads(r.band_layers or "[]")))
                 for k, r in rows.items()}
        before = {k: (s.streak, s.since_step, s.firing, s.attempt, s.step, s.band_layers) for k, s in state.items()}
        transitions = evaluate(rules, state, reports)
        alert_ids = {k: r.alert_id for k, r in rows.items()}
        queued = sum(self._apply_transition(conn, run, t, alert_ids, now) for t in transitions)
        changed = [{"run_pk": run.pk, "rule": rule, "layer": layer, "streak": s.streak, "since_step": s.since_step,
                    "band_layers": json.dumps(list(s.band_layers)), "alert_id": alert_ids.get((rule, layer)),
                    "attempt": s.attempt, "step": s.step}
                   for (rule, layer), s in state.items()
                   if before.get((rule, layer)) != (s.streak, s.since_step, s.firing, s.attempt, s.step, s.band_layers)]
        if changed:
            ingest.upsert(conn, m.alert_state, changed)
        return queued

    def _apply_transition(self, conn: sa.Connection, run: m.RunRow, t: Transition, alert_ids: dict, now: float) -> int:
        """Record a transition; returns the number of notifications queued (0 or 1)."""
        if t.kind == "firing":
            alert_id = conn.execute(sa.insert(m.alerts).values(
                run_pk=run.pk, rule=t.rule, severity=t.severity, state="firing", layers=json.dumps(list(t.layers)),
                metric=t.metric, summary=t.summary, onset_step=t.onset_step, starts_at=now,
            ).returning(m.alerts.c.id)).scalar_one()
            alert_ids[t.state_key] = alert_id
        else:
            alert_id = alert_ids.get(t.state_key)
            if alert_id is None:
                return 0
            values: dict[str, Any] = {"layers": json.dumps(list(t.layers)), "summary": t.summary}
            if t.kind == "resolved":
                values.update(state="resolved", resolved_step=t.step, ends_at=now)
                alert_ids[t.state_key] = None
            conn.execute(sa.update(m.alerts).where(m.alerts.c.id == alert_id).values(**values))
            if t.kind == "update":
                return 0
        conn.execute(sa.insert(m.notifications).values(
            alert_id=alert_id, status=t.kind, created_at=now, attempts=0, next_try_at=now, gave_up=False))
        return 1

    def list_alerts(self, *, projects: Sequence[str] | None, run_id: str | None = None, state: str | None = None,
                    limit: int = 500) -> list[m.AlertRow]:
        q = sa.select(m.alerts, m.runs.c.id.label("run_id"), m.runs.c.name.label("run_name"), m.runs.c.project) \
            .join(m.runs, m.runs.c.pk == m.alerts.c.run_pk)
        if projects is not None:
            q = q.where(m.runs.c.project.in_(list(projects)))
        if run_id:
            q = q.where(m.runs.c.id == run_id)
        if state:
            q = q.where(m.alerts.c.state == state)
        with self._read() as conn:
            rows = conn.execute(q.order_by(m.alerts.c.id.desc()).limit(limit)).all()
        return [self._alert_row(r) for r in rows]

    @staticmethod
    def _alert_row(r: sa.Row) -> m.AlertRow:
        return m.AlertRow(id=r.id, run_id=r.run_id, run_name=r.run_name, project=r.project, rule=r.rule,
                          severity=r.severity, state=r.state, metric=r.metric, layers=json.loads(r.layers),
                          summary=r.summary, onset_step=r.onset_step, resolved_step=r.resolved_step,
                          starts_at=r.starts_at, ends_at=r.ends_at)

    def claim_notifications(self, now: float, lease_s: float = 60.0, limit: int = 50) -> list[m.PendingNotification]:
        """Claim due notifications for delivery (a lease, so replicas do not send one twice)."""
        n = m.notifications
        due = sa.and_(n.c.delivered_at.is_(None), n.c.gave_up.is_(False), n.c.next_try_at <= now,
                      sa.or_(n.c.claimed_until.is_(None), n.c.claimed_until < now))
        out = []
        with self._write() as conn:
            ids = conn.execute(sa.select(n.c.id).where(due).order_by(n.c.id).limit(limit)).scalars().all()
            for nid in ids:
                if conn.execute(sa.update(n).where(n.c.id == nid, due).values(claimed_until=now + lease_s)).rowcount:
                    out.append(nid)
            if not out:
                return []
            rows = conn.execute(
                sa.select(n.c.id.label("nid"), n.c.attempts, n.c.status.label("nstatus"), m.alerts,
                          m.runs.c.id.label("run_id"), m.runs.c.name.label("run_name"), m.runs.c.project)
                .join(m.alerts, m.alerts.c.id == n.c.alert_id).join(m.runs, m.runs.c.pk == m.alerts.c.run_pk)
                .where(n.c.id.in_(out)).order_by(n.c.id)).all()
        return [m.PendingNotification(id=r.nid, attempts=r.attempts, status=r.nstatus, alert=self._alert_row(r))
                for r in rows]

    def finish_notification(self, nid: int, *, delivered: bool, error: str | None, next_try_at: float | None,
                            give_up: bool, now: float) -> None:
        n = m.notifications
        with self._write() as conn:
            conn.execute(sa.update(n).where(n.c.id == nid).values(
                attempts=n.c.attempts + 1, claimed_until=None, delivered_at=now if delivered else None,
                last_error=error, gave_up=give_up, next_try_at=next_try_at if next_try_at is not None else now))

    def notification_stats(self) -> dict[str, int]:
        n = m.notifications
        with self._read() as conn:
            rows = conn.execute(sa.select(
                sa.func.count().filter(n.c.delivered_at.is_not(None)),
                sa.func.count().filter(n.c.gave_up.is_(True)),
                sa.func.count().filter(n.c.delivered_at.is_(None), n.c.gave_up.is_(False)))).one()
        return {"delivered": rows[0], "gave_up": rows[1], "pending": rows[2]}

    # --- reads ------------------------------------------------------------------------------

    def _point_filter(self, run: m.RunRow, metric_id: int | None, head: int, attempt: int | None) -> list:
        p = m.points
        where = [p.c.run_pk == run.pk, p.c.metric_id == (-1 if metric_id is None else metric_id), p.c.head == head]
        if attempt is not None:
            where.append(p.c.attempt == attempt)
        elif run.latest_attempt > 1:
            # Merged view: per (step, metric, layer, head) the latest attempt that logged it wins.
            q = m.points.alias("newer")
            where.append(~sa.exists().where(
                q.c.run_pk == p.c.run_pk, q.c.metric_id == p.c.metric_id, q.c.head == p.c.head, q.c.layer == p.c.layer,
                q.c.step == p.c.step, q.c.attempt > p.c.attempt))
        return where

    def series(self, run: m.RunRow, metric: str, layer: int, *, head: int = m.LAYER_VALUE,
               start: int | None = None, end: int | None = None, max_points: int = 1000,
               attempt: int | None = None) -> m.Series:
        """One layer's (or a scalar's) values; more than ``max_points`` steps are bucketed keeping min and max."""
        p = m.points
        with self._read() as conn:
            where = [*self._point_filter(run, self._metric_id(conn, metric), head, attempt), p.c.layer == layer,
                     *_step_range(start, end)]
            n, lo, hi = conn.execute(sa.select(sa.func.count(), sa.func.min(p.c.step), sa.func.max(p.c.step))
                                     .where(*where)).one()
            if not n:
                return m.Series([], [], [], [], False)
            if n <= max_points:
                rows = conn.execute(sa.select(p.c.step, p.c.value).where(*where).order_by(p.c.step)).all()
                vals = [_nan(r.value) for r in rows]
                return m.Series([r.step for r in rows], vals, vals, vals, False)
            width = -(-(hi - lo + 1) // max_points)
            bucket = ((p.c.step - lo) // width).label("b")
            rows = conn.execute(sa.select(bucket, sa.func.min(p.c.step), sa.func.avg(p.c.value),
                                          sa.func.min(p.c.value), sa.func.max(p.c.value), sa.func.count(p.c.value))
                                .where(*where).group_by(bucket).order_by(bucket)).all()
        return m.Series([r[1] for r in rows], [_agg(r[2], r[5]) for r in rows], [_agg(r[3], r[5]) for r in rows],
                        [_agg(r[4], r[5]) for r in rows], True)

    def heatmap(self, run: m.RunRow, metric: str, *, start: int | None = None, end: int | None = None,
                max_steps: int = 500, agg: str = "max", head: int = m.LAYER_VALUE,
                attempt: int | None = None) -> m.Heatmap:
        """All layers of one metric over steps; steps bucketed to at most ``max_steps`` by ``agg`` (max by default)."""
        if head == m.LAYER_VALUE:
            return self._heatmap_from_frames(run, metric, start, end, max_steps, agg, attempt)
        p = m.points
        fn = {"max": sa.func.max, "min": sa.func.min, "mean": sa.func.avg}[agg]
        with self._read() as conn:
            where = [*self._point_filter(run, self._metric_id(conn, metric), head, attempt), p.c.layer >= 0,
                     *_step_range(start, end)]
            lo, hi = conn.execute(sa.select(sa.func.min(p.c.step), sa.func.max(p.c.step)).where(*where)).one()
            if lo is None:
                return m.Heatmap([], [], [], False)
            width = max(1, -(-(hi - lo + 1) // max_steps))
            bucket = ((p.c.step - lo) // width).label("b") if width > 1 else p.c.step.label("b")
            rows = conn.execute(sa.select(bucket, p.c.layer, sa.func.min(p.c.step), fn(p.c.value),
                                          sa.func.count(p.c.value))
                                .where(*where).group_by(bucket, p.c.layer)).all()
        return _pivot(rows, width > 1)

    def _heatmap_from_frames(self, run: m.RunRow, metric: str, start: int | None, end: int | None,
                             max_steps: int, agg: str, attempt: int | None) -> m.Heatmap:
        f = m.frames
        with self._read() as conn:
            metric_id = self._metric_id(conn, metric)
            where = [f.c.run_pk == run.pk, f.c.metric_id == (-1 if metric_id is None else metric_id)]
            where += [f.c.step >= start] if start is not None else []
            where += [f.c.step <= end] if end is not None else []
            where += [f.c.attempt == attempt] if attempt is not None else []
            rows = conn.execute(sa.select(f.c.step, f.c.vals, f.c.present, f.c.has_nan).where(*where)
                                .order_by(f.c.step, f.c.attempt, f.c.mask)).all()
        steps, layers, values, downsampled = frames.heatmap(frames.merge_steps(rows), max_steps, agg)
        return m.Heatmap(steps, layers, values, downsampled)

    def compare_runs(self, run_ids: Sequence[str]) -> list[m.RunRow]:
        with self._read() as conn:
            rows = {r.id: _run_row(r) for r in conn.execute(sa.select(m.runs).where(m.runs.c.id.in_(list(run_ids))))}
        missing = [i for i in run_ids if i not in rows]
        if missing:
            raise NotFound(f"run {missing[0]} not found")
        return [rows[i] for i in run_ids]

    def export_rows(self, run: m.RunRow, attempt: int | None = None, chunk: int = 5000) -> Iterator[tuple]:
        """Every point of the run (merged view unless ``attempt``) as (attempt, step, metric, layer, head, value)."""
        p = m.points
        where = [p.c.run_pk == run.pk]
        if attempt is not None:
            where.append(p.c.attempt == attempt)
        elif run.latest_attempt > 1:
            q = m.points.alias("newer")
            where.append(~sa.exists().where(
                q.c.run_pk == p.c.run_pk, q.c.metric_id == p.c.metric_id, q.c.head == p.c.head, q.c.layer == p.c.layer,
                q.c.step == p.c.step, q.c.attempt > p.c.attempt))
        names = m.metric_names
        stmt = sa.select(p.c.attempt, p.c.step, names.c.name.label("metric"), p.c.layer, p.c.head, p.c.value) \
            .join(names, names.c.id == p.c.metric_id).where(*where) \
            .order_by(p.c.metric_id, p.c.head, p.c.layer, p.c.step, p.c.attempt)
        with self.engine.connect() as conn:
            result = conn.execution_options(yield_per=chunk).execute(stmt)
            for r in result:
                yield (r.attempt, r.step, r.metric, r.layer, r.head, _nan(r.value))

    def list_events(self, run: m.RunRow, *, kind: str | None = None, attempt: int | None = None,
                    limit: int = 1000) -> list[m.EventRow]:
        e = m.events
        q = sa.select(e).where(e.c.run_pk == run.pk)
        if kind:
            q = q.where(e.c.kind == kind)
        if attempt is not None:
            q = q.where(e.c.attempt == attempt)
        with self._read() as conn:
            rows = conn.execute(q.order_by(e.c.step, e.c.attempt, e.c.kind).limit(limit)).all()
        return [m.EventRow(r.attempt, r.step, r.kind, r.message, clip_depth(json.loads(r.data)), r.time) for r in rows]

    def run_metrics(self, run: m.RunRow) -> dict[str, list[int]]:
        """Metric name -> layers that reported it (``[-1]`` for a run-level scalar)."""
        with self._read() as conn:
            rows = conn.execute(sa.select(m.latest.c.metric, m.latest.c.layer).where(m.latest.c.run_pk == run.pk)
                                .order_by(m.latest.c.metric, m.latest.c.layer)).all()
        out: dict[str, list[int]] = {}
        for r in rows:
            out.setdefault(r.metric, []).append(r.layer)
        return out

    def latest_snapshot(self, metrics: Sequence[str], max_runs: int, max_layers: int,
                        projects: Sequence[str] | None = None) -> tuple[list[m.RunRow], list[m.LatestRow]]:
        """Running runs (most recently updated first, at most ``max_runs``; of ``projects``, None = all)
        and their latest values."""
        where = [m.runs.c.status == "running"]
        if projects is not None:
            where.append(m.runs.c.project.in_(list(projects)))
        with self._read() as conn:
            runs = [_run_row(r) for r in conn.execute(sa.select(m.runs).where(*where)
                                                      .order_by(m.runs.c.updated_at.desc()).limit(max_runs))]
            if not runs:
                return [], []
            by_pk = {r.pk: r for r in runs}
            rows = conn.execute(sa.select(m.latest).where(
                m.latest.c.run_pk.in_(list(by_pk)), m.latest.c.metric.in_(list(metrics)),
                m.latest.c.layer < max_layers)).all()
        return runs, [m.LatestRow(by_pk[r.run_pk].id, by_pk[r.run_pk].name, by_pk[r.run_pk].project, r.metric,
                                  r.layer, r.step, _nan(r.value)) for r in rows]

    # --- lambdas ----------------------------------------------------------------------------

    def lambda_state(self, run_id: str) -> tuple[m.RunRow, m.LambdaState]:
        with self._read() as conn:
            run = self._get(conn, m.runs.c.id == run_id)
            return run, self._lambda_state(conn, run)

    def _lambda_state(self, conn: sa.Connection, run: m.RunRow) -> m.LambdaState:
        # One round trip for both (GET /lambdas is on the trainer's path).
        ls, lo = m.lambda_state, m.lambda_overrides
        rows = conn.execute(sa.union_all(
            sa.select(sa.literal(0).label("kind"), ls.c.layer, ls.c.h.label("v")).where(ls.c.run_pk == run.pk),
            sa.select(sa.literal(1).label("kind"), lo.c.layer, lo.c.value.label("v")).where(lo.c.run_pk == run.pk),
        )).all()
        h = {r.layer: r.v for r in rows if r.kind == 0}
        ov = {r.layer: r.v for r in rows if r.kind == 1}
        n = _layer_count(run.config)
        n_layers = n if n is not None else (min(max(h) + 1, MAX_LAYERS) if h else None)
        return m.LambdaState(version=run.lambda_version, step=run.lambda_step, n_layers=n_layers, h=h, overrides=ov)

    def set_overrides(self, run_id: str, overrides: dict[int, float | None], who: str,
                      now: float | None = None) -> tuple[m.RunRow, m.LambdaState]:
        """Apply operator overrides (None removes one) after validating all of them; audited.

        Raises:
            Invalid: naming the layer and the bound, for any bad value; nothing is applied then.
        """
        now = time.time() if now is None else now
        with self._write() as conn:
            run = _run_row(self._locked(conn, run_id))
            state = self._lambda_state(conn, run)
            cfg = scheduling.ScheduleConfig.from_mapping(run.config.get("schedule"))
            for layer, value in overrides.items():
                try:
                    scheduling.check_override(layer, 0.0 if value is None else value, cfg, state.n_layers)
                except ValueError as exc:
                    raise Invalid(str(exc)) from None
            changes = [(la, state.overrides.get(la), v) for la, v in sorted(overrides.items())
                       if state.overrides.get(la) != v]
            if changes:
                self._write_overrides(conn, run, changes, state.step, run.lambda_version + 1, who, now)
            run = self._get(conn, m.runs.c.pk == run.pk)
            return run, self._lambda_state(conn, run)

    def _clip_overrides(self, conn: sa.Connection, run: m.RunRow, cfg: scheduling.ScheduleConfig, attempt: int,
                        now: float) -> None:
        """Clip overrides above the (new) config's ``lambda_max``: audited, and an event on the run.

        An operator may set overrides before the trainer sends its config, or a resume may lower
        ``lambda_max``; the trainer refuses values above its bound, so they are clipped here
        rather than lost there.
        """
        o = m.lambda_overrides
        rows = conn.execute(sa.select(o.c.layer, o.c.value).where(o.c.run_pk == run.pk, o.c.value > cfg.lambda_max)
                            .order_by(o.c.layer)).all()
        if not rows:
            return
        changes = [(r.layer, r.value, cfg.lambda_max) for r in rows]
        self._write_overrides(conn, run, changes, run.lambda_step, run.lambda_version + 1, CLIP_WHO, now)
        clipped = [{"layer": layer, "requested": old, "applied": new} for layer, old, new in changes]
        message = (f"overrides of layers {[c['layer'] for c in clipped]} clipped to the run config's "
                   f"lambda_max={cfg.lambda_max}")
        logger.info("run %s: %s", run.id, message)
        self._insert_events(conn, run.pk, attempt, [(max(run.last_step or 0, 0), "overrides_clipped", message,
                                                     {"layers": clipped, "lambda_max": cfg.lambda_max}, now)])

    def _write_overrides(self, conn: sa.Connection, run: m.RunRow, changes: list, step: int | None, version: int,
                         who: str, now: float) -> None:
        o = m.lambda_overrides
        for layer, _old, new in changes:
            conn.execute(sa.delete(o).where(o.c.run_pk == run.pk, o.c.layer == layer))
            if new is not None:
                conn.execute(sa.insert(o).values(run_pk=run.pk, layer=layer, value=new))
        conn.execute(sa.insert(m.lambda_audit), [
            {"run_pk": run.pk, "layer": layer, "old": old, "new": new, "who": who, "at": now, "step": step,
             "version": version} for layer, old, new in changes])
        conn.execute(sa.update(m.runs).where(m.runs.c.pk == run.pk).values(lambda_version=version, updated_at=now))

    def lambda_audit(self, run: m.RunRow) -> list[m.AuditRow]:
        a = m.lambda_audit
        with self._read() as conn:
            rows = conn.execute(sa.select(a).where(a.c.run_pk == run.pk).order_by(a.c.id)).all()
        return [m.AuditRow(r.layer, r.old, r.new, r.who, r.at, r.step, r.version) for r in rows]

    # --- tokens -----------------------------------------------------------------------------

    def create_token(self, project: str, scopes: Sequence[str], name: str | None = None,
                     now: float | None = None) -> tuple[m.TokenRow, str]:
        """Mint a token; returns its row and the secret, which is not stored (only its sha256)."""
        token_id = secrets.token_hex(6)
        secret = f"qkw_{token_id}_{secrets.token_urlsafe(32)}"
        row = m.TokenRow(id=token_id, project=project, name=name or token_id, scopes=frozenset(scopes),
                         hash=hash_token(secret), revoked_at=None)
        with self._write() as conn:
            conn.execute(sa.insert(m.tokens).values(
                id=row.id, project=project, name=row.name, scopes=",".join(sorted(row.scopes)), hash=row.hash,
                created_at=time.time() if now is None else now))
        return row, secret

    def token_by_hash(self, digest: str) -> m.TokenRow | None:
        with self._read() as conn:
            r = conn.execute(sa.select(m.tokens).where(m.tokens.c.hash == digest)).first()
        if r is None:
            return None
        return m.TokenRow(id=r.id, project=r.project, name=r.name, scopes=frozenset(filter(None, r.scopes.split(","))),
                          hash=r.hash, revoked_at=r.revoked_at)

    def list_tokens(self) -> list[m.TokenRow]:
        with self._read() as conn:
            rows = conn.execute(sa.select(m.tokens).order_by(m.tokens.c.created_at)).all()
        return [m.TokenRow(r.id, r.project, r.name, frozenset(r.scopes.split(",")), r.hash, r.revoked_at) for r in rows]

    def revoke_token(self, token_id: str, now: float | None = None) -> bool:
        with self._write() as conn:
            return bool(conn.execute(sa.update(m.tokens).where(m.tokens.c.id == token_id).values(
                revoked_at=time.time() if now is None else now)).rowcount)

    # --- runs by name, by what happened in them, and whole-run history -----------------------

    def get_run_by_name(self, project: str, name: str) -> m.RunRow:
        """The run ``project/name``.

        Raises:
            NotFound: no such run.
        """
        with self._read() as conn:
            return self._get(conn, sa.and_(m.runs.c.project == project, m.runs.c.name == name))

    def has_points(self, run: m.RunRow, metric: str, head: int) -> bool:
        """Whether the run stored any point of ``metric`` for ``head`` (-1: layer values and scalars)."""
        p = m.points
        with self._read() as conn:
            metric_id = self._metric_id(conn, metric)
            if metric_id is None:
                return False
            q = sa.select(sa.literal(1)).where(p.c.run_pk == run.pk, p.c.metric_id == metric_id, p.c.head == head)
            return conn.execute(q.limit(1)).first() is not None

    def search_runs(self, *, projects: Sequence[str] | None, status: str | None = None, name: str | None = None,
                    created: tuple[float | None, float | None] = (None, None),
                    updated: tuple[float | None, float | None] = (None, None),
                    ever_above: tuple[str, float] | None = None, latest_above: tuple[str, float] | None = None,
                    alerts: Sequence[tuple[Sequence[str], bool]] = (), limit: int = 100,
                    offset: int = 0) -> tuple[list[m.RunRow], int]:
        """Runs matching every filter given, newest activity first, and their count.

        Args:
            projects: the projects to look in; None = all.
            created, updated: (after, before) bounds in epoch seconds, inclusive; None = open.
            ever_above: (metric, x): some layer value or scalar of ``metric``, at any step of any
                attempt, was above x (NaN never is; +inf always is).
            latest_above: (metric, x): the latest value of some layer (or the scalar) is above x.
            alerts: (rule names, wanted) pairs: the run has (wanted True) or has not (False) had
                an alert, firing or resolved, of one of the rules.
        """
        r = m.runs
        where = []
        if projects is not None:
            where.append(r.c.project.in_(list(projects)))
        where += [r.c.status == status] if status else []
        where += [r.c.name == name] if name else []
        for column, (after, before) in ((r.c.created_at, created), (r.c.updated_at, updated)):
            where += [column >= after] if after is not None else []
            where += [column <= before] if before is not None else []
        with self._read() as conn:
            if ever_above is not None:
                where.append(self._ever_above(conn, *ever_above))
            if latest_above is not None:
                lt = m.latest
                where.append(sa.exists().where(lt.c.run_pk == r.c.pk, lt.c.metric == latest_above[0],
                                               lt.c.value > latest_above[1]))
            for rules, wanted in alerts:
                a = m.alerts
                had = sa.exists().where(a.c.run_pk == r.c.pk, a.c.rule.in_(list(rules)))
                where.append(had if wanted else ~had)
            count = conn.execute(sa.select(sa.func.count()).select_from(r).where(*where)).scalar()
            rows = conn.execute(sa.select(r).where(*where).order_by(r.c.updated_at.desc(), r.c.pk.desc())
                                .limit(limit).offset(offset)).all()
        return [_run_row(row) for row in rows], int(count or 0)

    def _ever_above(self, conn: sa.Connection, metric: str, threshold: float) -> sa.ColumnElement[bool]:
        metric_id = self._metric_id(conn, metric)
        if metric_id is None:
            return sa.false()
        p = m.points
        # An index range per run: (run_pk, metric_id, head) is the primary key's prefix.
        return sa.exists().where(p.c.run_pk == m.runs.c.pk, p.c.metric_id == metric_id, p.c.head == m.LAYER_VALUE,
                                 p.c.value > threshold)

    def history(self, run: m.RunRow, metrics: Sequence[str], *, start: int | None = None, end: int | None = None,
                attempt: int | None = None, max_points: int | None = None) -> dict[str, m.Heatmap]:
        """Every layer value and run-level scalar of ``metrics``, unbucketed: per metric, steps x layers.

        Layer values come from the frames (one row per report and metric, as the heatmap reads
        them), scalars from the points, as layer -1. Per (step, layer) the latest attempt that
        logged it wins, unless ``attempt`` picks one. A cell is None where nothing was measured;
        a metric without values in the range is absent.

        Raises:
            Invalid: the answer would hold more than ``max_points`` values.
        """
        rows = self._history_rows(run, metrics, start, end, attempt, max_points)
        return {name: _grid(frames.merge_steps(r[1:] for r in fr), sc) for name, (fr, sc) in rows.items()}

    def history_doubles(self, run: m.RunRow, metrics: Sequence[str], *, start: int | None = None,
                        end: int | None = None, attempt: int | None = None,
                        max_points: int | None = None) -> dict[str, tuple[list[int], list[int], bytes, bytes | None]]:
        """:meth:`history` as float64 bytes: per metric (steps, layers, values, measured).

        ``values`` holds the steps x layers doubles, step-major, in native byte order, NaN where
        nothing was measured; ``measured`` one byte per value (1: measured), or None when all were.
        A metric stored as one full frame per step (one attempt, every layer reported at once: the
        usual run) is its frames' bytes as stored, with no value handled one by one.
        """
        out = {}
        for name, (fr, sc) in self._history_rows(run, metrics, start, end, attempt, max_points).items():
            if not sc and _one_full_frame_per_step(fr):
                out[name] = ([r[1] for r in fr], list(range(len(fr[0][2]) // 8)), b"".join(r[2] for r in fr), None)
            else:
                out[name] = _doubles(_grid(frames.merge_steps(r[1:] for r in fr), sc))
        return out

    def _history_rows(self, run: m.RunRow, metrics: Sequence[str], start: int | None, end: int | None,
                      attempt: int | None, max_points: int | None) -> dict[str, tuple[list, list]]:
        """Per metric with values: its frame rows (metric id, step, vals, present, has_nan) in (step, attempt)
        order, and its scalar points (step, value) in the merged view (or of ``attempt``)."""
        f, p = m.frames, m.points
        with self._read() as conn:
            ids = {i: name for name in metrics if (i := self._metric_id(conn, name)) is not None}
            if not ids:
                return {}
            fw = [f.c.run_pk == run.pk, f.c.metric_id.in_(list(ids))]
            fw += [f.c.step >= start] if start is not None else []
            fw += [f.c.step <= end] if end is not None else []
            fw += [f.c.attempt == attempt] if attempt is not None else []
            frame_rows = conn.execute(sa.select(f.c.metric_id, f.c.step, f.c.vals, f.c.present, f.c.has_nan)
                                      .where(*fw).order_by(f.c.metric_id, f.c.step, f.c.attempt, f.c.mask)).all()
            values = sum(len(row[2]) for row in frame_rows) // 8
            if max_points is not None and values > max_points:
                raise Invalid(f"the history holds {values} values, more than {max_points} in one answer: "
                              "ask for fewer metrics or a step range (start, end)")
            pw = [p.c.run_pk == run.pk, p.c.metric_id.in_(list(ids)), p.c.head == m.LAYER_VALUE,
                  p.c.layer == m.RUN_SCALAR, *_step_range(start, end)]
            if attempt is not None:
                pw.append(p.c.attempt == attempt)
            elif run.latest_attempt > 1:
                q = m.points.alias("newer")
                pw.append(~sa.exists().where(q.c.run_pk == p.c.run_pk, q.c.metric_id == p.c.metric_id,
                                             q.c.head == p.c.head, q.c.layer == p.c.layer, q.c.step == p.c.step,
                                             q.c.attempt > p.c.attempt))
            scalar_rows = conn.execute(sa.select(p.c.metric_id, p.c.step, p.c.value).where(*pw)
                                       .order_by(p.c.metric_id, p.c.step)).all()
        by_metric: dict[int, tuple[list, list]] = {i: ([], []) for i in ids}
        for row in frame_rows:
            by_metric[row[0]][0].append(row)
        for row in scalar_rows:
            by_metric[row.metric_id][1].append((row.step, _nan(row.value)))
        return {ids[i]: (fr, sc) for i, (fr, sc) in by_metric.items() if fr or sc}


def _step_range(start: int | None, end: int | None) -> list:
    out = []
    if start is not None:
        out.append(m.points.c.step >= start)
    if end is not None:
        out.append(m.points.c.step <= end)
    return out


def _agg(value: float | None, non_null: int) -> float:
    """An aggregate over a bucket: NULL with no non-NaN member means every member was NaN."""
    return math.nan if value is None or not non_null else float(value)


def _pivot(rows: Sequence[sa.Row], downsampled: bool) -> m.Heatmap:
    buckets = sorted({r[0] for r in rows})
    layers = sorted({r[1] for r in rows})
    bi = {b: i for i, b in enumerate(buckets)}
    li = {la: i for i, la in enumerate(layers)}
    steps: list[int] = [0] * len(buckets)
    first = [True] * len(buckets)
    values: list[list[float | None]] = [[None] * len(layers) for _ in buckets]
    for b, layer, step, value, non_null in rows:
        i = bi[b]
        if first[i] or step < steps[i]:
            steps[i], first[i] = step, False
        values[i][li[layer]] = _agg(value, non_null)
    return m.Heatmap(steps, layers, values, downsampled)


def _grid(steps: list, scalars: list[tuple[int, float]]) -> m.Heatmap:
    """Merged frames (``frames.merge_steps``) and scalar points -> a steps x layers grid (layer -1: the scalar)."""
    n = max((len(s.values) for s in steps), default=0)
    seen = [False] * n
    for s in steps:
        if s.clean:
            seen[: len(s.values)] = [True] * len(s.values)
        else:
            for i, v in enumerate(s.values):
                seen[i] = seen[i] or v is not None
    layers = [i for i in range(n) if seen[i]]
    rows = {s.step: s.values if len(s.values) == n else s.values + [None] * (n - len(s.values)) for s in steps}
    if len(layers) < n:
        rows = {step: [row[i] for i in layers] for step, row in rows.items()}
    if not scalars:
        return m.Heatmap(list(rows), layers, list(rows.values()), False)
    by_step = dict(scalars)
    order = sorted(rows.keys() | by_step.keys())
    empty = [None] * len(layers)
    return m.Heatmap(order, [m.RUN_SCALAR, *layers], [[by_step.get(s), *rows.get(s, empty)] for s in order], False)


def _one_full_frame_per_step(rows: list) -> bool:
    """Frame rows (metric id, step, vals, present, has_nan) that are the grid as they are: one per step,
    every layer."""
    return bool(rows) and all(r[3] is None for r in rows) and len({len(r[2]) for r in rows}) == 1 and \
        all(a[1] < b[1] for a, b in pairwise(rows))


def _doubles(grid: m.Heatmap) -> tuple[list[int], list[int], bytes, bytes | None]:
    """A grid -> (steps, layers, float64 bytes step-major with NaN where not measured, measured bytes or None)."""
    vals, measured, holes = array("d"), bytearray(), False
    for row in grid.values:
        if None in row:
            holes = True
            vals.extend(math.nan if v is None else v for v in row)
            measured += bytes(v is not None for v in row)
        else:
            vals.extend(row)
            measured += b"\x01" * len(row)
    return grid.steps, grid.layers, vals.tobytes(), bytes(measured) if holes else None
