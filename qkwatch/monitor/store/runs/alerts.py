"""Alerts and their notifications as rows: the evaluator's ledger, the alert list, the outbox.

What fires and resolves is decided in :mod:`qkwatch.monitor.alerting`; this module only writes it down.
Notifications are an outbox: queued in the transaction that raised the alert, claimed with a
lease by whichever replica's notifier delivers them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from qkwatch.contract.responses import AlertPublic
from qkwatch.contract.values import encode_value
from qkwatch.monitor.alerting.records import PendingNotification
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql
from qkwatch.rules.evaluator import StateKey, StoredState
from qkwatch.rules.transitions import Transition

_STATES = (
    sa.select(m.alert_state, m.alerts.c.state.label("alert_row_state"))
    .select_from(m.alert_state.outerjoin(m.alerts, m.alerts.c.id == m.alert_state.c.alert_id))
    .where(m.alert_state.c.run_pk == sa.bindparam("run_pk"))
)
"""A run's rule states with the state of each one's alert (built once: it runs in every ingest)."""


class AlertRows:
    """The :class:`qkwatch.rules.evaluator.AlertLedger` of one run, inside the ingest transaction."""

    def __init__(self, conn: sa.Connection, run_pk: int, now: float) -> None:
        self.conn, self.run_pk, self.now = conn, run_pk, now

    def load_states(self) -> dict[StateKey, StoredState]:
        return {
            (r.rule, r.layer): StoredState(
                streak=r.streak,
                since_step=r.since_step,
                attempt=r.attempt,
                step=r.step,
                band_layers=tuple(json.loads(r.band_layers or "[]")),
                alert_id=r.alert_id,
                memory=json.loads(r.memory) if r.memory else None,
                alert_ended=r.alert_row_state == "ended",
            )
            for r in self.conn.execute(_STATES, {"run_pk": self.run_pk})
        }

    def save_states(self, states: dict[StateKey, StoredState]) -> None:
        sql.upsert(
            self.conn,
            m.alert_state,
            [
                {
                    "run_pk": self.run_pk,
                    "rule": rule,
                    "layer": layer,
                    "streak": s.streak,
                    "since_step": s.since_step,
                    "band_layers": json.dumps(list(s.band_layers)),
                    "alert_id": s.alert_id,
                    "attempt": s.attempt,
                    "step": s.step,
                    "memory": json.dumps(s.memory, separators=(",", ":")) if s.memory else None,
                }
                for (rule, layer), s in states.items()
            ],
        )

    def open_alert(self, t: Transition) -> int:
        alert_id: int = self.conn.execute(
            sa.insert(m.alerts)
            .values(
                run_pk=self.run_pk,
                rule=t.rule,
                severity=t.severity,
                state="firing",
                layers=json.dumps(list(t.layers)),
                metric=t.metric,
                summary=t.summary,
                onset_step=t.onset_step,
                starts_at=self.now,
                predicted_step=t.predicted_step,
            )
            .returning(m.alerts.c.id)
        ).scalar_one()
        return alert_id

    def update_alert(self, alert_id: int, t: Transition) -> None:
        self._update(alert_id, layers=json.dumps(list(t.layers)), summary=t.summary)

    def resolve_alert(self, alert_id: int, t: Transition) -> None:
        self._update(
            alert_id,
            layers=json.dumps(list(t.layers)),
            summary=t.summary,
            state="resolved",
            resolved_step=t.step,
            ends_at=self.now,
            **_NOT_ENDED,
        )

    def end_alert(self, alert_id: int, step: int | None, how: str) -> None:
        metric, layers = self.conn.execute(
            sa.select(m.alerts.c.metric, m.alerts.c.layers).where(m.alerts.c.id == alert_id)
        ).one()
        values = self._latest(metric, json.loads(layers))
        self._update(
            alert_id, state="ended", ended_step=step, run_end=how, ends_at=self.now, last_values=json.dumps(values)
        )

    def reopen_alert(self, alert_id: int) -> None:
        self._update(alert_id, state="firing", ends_at=None, **_NOT_ENDED)

    def _latest(self, metric: str, layers: list[int]) -> list[float | str | None]:
        """The run's latest value of ``metric`` on each of ``layers``, wire-encoded (NULL in the table is NaN)."""
        lt = m.latest
        rows = self.conn.execute(
            sa.select(lt.c.layer, lt.c.value).where(
                lt.c.run_pk == self.run_pk, lt.c.metric == metric, lt.c.layer.in_(layers)
            )
        ).all()
        found = {r.layer: encode_value(sql.from_db(r.value)) for r in rows}
        return [found.get(layer) for layer in layers]

    def queue_notification(self, alert_id: int, status: str) -> None:
        self.conn.execute(
            sa.insert(m.notifications).values(
                alert_id=alert_id, status=status, created_at=self.now, attempts=0, next_try_at=self.now, gave_up=False
            )
        )

    def _update(self, alert_id: int, **values: object) -> None:
        self.conn.execute(sa.update(m.alerts).where(m.alerts.c.id == alert_id).values(**values))


_NOT_ENDED: dict[str, Any] = {"ended_step": None, "run_end": None, "last_values": None}
"""What an alert that fires again, or resolves, no longer says about its run's end."""


def alert_public(r: sa.Row[Any]) -> AlertPublic:
    """The alert of a row of ``alerts`` joined with its run's id, name and project: the one place the
    table becomes the contract's record (the API lists it, the notifier formats it)."""
    return AlertPublic(
        id=r.id,
        run=r.run_id,
        run_name=r.run_name,
        project=r.project,
        rule=r.rule,
        severity=r.severity,
        state=r.state,
        metric=r.metric,
        layers=json.loads(r.layers),
        summary=r.summary,
        onset_step=r.onset_step,
        resolved_step=r.resolved_step,
        starts_at=r.starts_at,
        ends_at=r.ends_at,
        predicted_step=r.predicted_step,
        ended_step=r.ended_step,
        run_end=r.run_end,
        last_values=json.loads(r.last_values) if r.last_values else None,
    )


def select(
    conn: sa.Connection, projects: Sequence[str] | None, run_id: str | None, state: str | None, limit: int
) -> list[AlertPublic]:
    """Alerts of ``projects`` (None = all), of one run, in one state; newest first."""
    q = sa.select(m.alerts, m.runs.c.id.label("run_id"), m.runs.c.name.label("run_name"), m.runs.c.project).join(
        m.runs, m.runs.c.pk == m.alerts.c.run_pk
    )
    if projects is not None:
        q = q.where(m.runs.c.project.in_(list(projects)))
    if run_id:
        q = q.where(m.runs.c.id == run_id)
    if state:
        q = q.where(m.alerts.c.state == state)
    rows = conn.execute(q.order_by(m.alerts.c.id.desc()).limit(limit)).all()
    return [alert_public(r) for r in rows]


# --- the notification outbox ------------------------------------------------------------------


def claim_notifications(conn: sa.Connection, now: float, lease_s: float, limit: int) -> list[PendingNotification]:
    """Claim due notifications for delivery (a lease, so replicas do not send one twice)."""
    n = m.notifications
    due = sa.and_(
        n.c.delivered_at.is_(None),
        n.c.gave_up.is_(False),
        n.c.next_try_at <= now,
        sa.or_(n.c.claimed_until.is_(None), n.c.claimed_until < now),
    )
    ids = conn.execute(sa.select(n.c.id).where(due).order_by(n.c.id).limit(limit)).scalars().all()
    claimed = []
    for nid in ids:  # another replica may have claimed it since the select: the update then matches nothing
        if conn.execute(sa.update(n).where(n.c.id == nid, due).values(claimed_until=now + lease_s)).rowcount:
            claimed.append(nid)
    if not claimed:
        return []
    rows = conn.execute(
        sa.select(
            n.c.id.label("nid"),
            n.c.attempts,
            n.c.status.label("nstatus"),
            m.alerts,
            m.runs.c.id.label("run_id"),
            m.runs.c.name.label("run_name"),
            m.runs.c.project,
        )
        .join(m.alerts, m.alerts.c.id == n.c.alert_id)
        .join(m.runs, m.runs.c.pk == m.alerts.c.run_pk)
        .where(n.c.id.in_(claimed))
        .order_by(n.c.id)
    ).all()
    return [PendingNotification(id=r.nid, attempts=r.attempts, status=r.nstatus, alert=alert_public(r)) for r in rows]


def finish_notification(
    conn: sa.Connection,
    nid: int,
    *,
    delivered: bool,
    error: str | None,
    next_try_at: float | None,
    give_up: bool,
    now: float,
) -> None:
    """Record a delivery attempt and release the claim."""
    n = m.notifications
    conn.execute(
        sa.update(n)
        .where(n.c.id == nid)
        .values(
            attempts=n.c.attempts + 1,
            claimed_until=None,
            delivered_at=now if delivered else None,
            last_error=error,
            gave_up=give_up,
            next_try_at=next_try_at if next_try_at is not None else now,
        )
    )


def notification_stats(conn: sa.Connection) -> dict[str, int]:
    """How many notifications were delivered, given up, and are still pending."""
    n = m.notifications
    row = conn.execute(
        sa.select(
            sa.func.count().filter(n.c.delivered_at.is_not(None)),
            sa.func.count().filter(n.c.gave_up.is_(True)),
            sa.func.count().filter(n.c.delivered_at.is_(None), n.c.gave_up.is_(False)),
        )
    ).one()
    return {"delivered": row[0], "gave_up": row[1], "pending": row[2]}
