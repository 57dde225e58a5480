"""An alert and a queued notification of it, as the store hands them up.

They live here, below the store, because alerting's notifier formats them and the store fills
them: the store imports alerting, never the reverse. The API lists the same :class:`AlertRow`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlertRow:
    """One alert of one run, firing or resolved (``resolved_step``/``ends_at`` None while it fires)."""

    id: int
    run_id: str
    run_name: str
    project: str
    rule: str
    severity: str
    state: str
    metric: str
    layers: list[int]
    summary: str
    onset_step: int
    resolved_step: int | None
    starts_at: float
    ends_at: float | None
    predicted_step: int | None = None
    """A forecast rule's alert: the step at which it predicted the crossing when it fired."""


@dataclass
class PendingNotification:
    """A notification in the outbox that a notifier has claimed: ``status`` is "firing" or "resolved"."""

    id: int
    attempts: int
    status: str
    alert: AlertRow
