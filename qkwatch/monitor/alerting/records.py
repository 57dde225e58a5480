"""An alert and a queued notification of it, as the store hands them up.

They live here, below the store, because alerting's notifier formats them and the store fills
them: the store imports alerting, never the reverse. The API lists the same :class:`AlertRow`.
"""

from __future__ import annotations

from dataclasses import dataclass

Value = float | str | None
"""A value as the wire encodes it: a number, ``"nan"``, ``"inf"`` or ``"-inf"``; None: not measured."""

STATES = ("firing", "resolved", "ended")
"""An alert's states. ``ended``: it was firing when its run ended (finished, crashed or stale) and
nothing resolved it; ``ended_step``, ``run_end`` and ``last_values`` say where, how and with what."""


@dataclass(frozen=True)
class AlertRow:
    """One alert of one run: firing, resolved, or ended with its run while firing (:data:`STATES`).

    ``resolved_step`` is set only once it resolved; ``ends_at`` once it resolved or its run ended.
    """

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
    ended_step: int | None = None
    """State ``ended``: the run's last step when it ended."""
    run_end: str | None = None
    """State ``ended``: how the run ended, ``finished``, ``crashed`` or ``stale``."""
    last_values: list[Value] | None = None
    """State ``ended``: the metric on each of ``layers`` (same order) when the run ended; None for an
    alert that ended before they were kept (migration 0008)."""


@dataclass
class PendingNotification:
    """A notification in the outbox that a notifier has claimed: ``status`` is "firing", "resolved" or
    "ended" (the run ended while the alert fired)."""

    id: int
    attempts: int
    status: str
    alert: AlertRow
