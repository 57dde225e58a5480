"""A queued notification of an alert, as the store hands it up to the notifier.

It lives here, below the store, because alerting's notifier formats it and the store fills it: the
store imports alerting, never the reverse. The alert itself is the contract's
:class:`qkwatch.contract.responses.AlertPublic`, the record the API lists too; the store makes it
from its rows in one place (``qkwatch.monitor.store.runs.alerts.alert_public``).
"""

from __future__ import annotations

from dataclasses import dataclass

from qkwatch.contract.responses import AlertPublic


@dataclass
class PendingNotification:
    """A notification in the outbox that a notifier has claimed: ``status`` is "firing", "resolved" or
    "ended" (the run ended while the alert fired)."""

    id: int
    attempts: int
    status: str
    alert: AlertPublic
