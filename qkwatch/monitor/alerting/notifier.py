"""Delivery of alert notifications to webhooks, in Alertmanager's webhook JSON format, with retries.

Notifications are an outbox in the database (queued in the same transaction as the alert), so
none is lost when the process dies; a replica claims a due one with a lease before sending it,
so several replicas do not send it twice. A failed delivery is retried with exponential backoff
up to ``webhook_max_attempts`` times, then given up and logged.

**A run that ends while an alert fires.** Alertmanager's format knows two statuses, ``firing``
and ``resolved``; qkwatch's alert has a third, ``ended`` (the run finished, crashed or went stale
while the alert fired: see :mod:`qkwatch.rules.evaluator`). Its notification is sent as
``firing``, with the same fingerprint as the alert's first one, and says so in its annotations:
``run_ended`` (``finished``, ``crashed`` or ``stale``), ``ended_step`` (the run's last step),
``last_values`` (``layer=value`` of the alert's metric at the end) and a summary that begins "run
ended while firing". ``resolved`` would be the dishonest choice: nothing resolved it, the layer's
QKAI may well still be 0.93 in the model the run left behind, and a receiver shows a resolved alert
as healed (green, closed incident) whatever an annotation adds. ``firing`` keeps the incident open
until someone looks, which is what the alert asks for; the annotations tell them that no later
notification will resolve it by itself, unless the run resumes: then the same alert (same
fingerprint) either fires on or resolves, and the receiver hears that too. The annotation is not a
label on purpose: labels are an alert's identity to Alertmanager, and a label would make the end
a different alert.

The notifier needs two things of the store, the :class:`Outbox` protocol, and the notifications it
hands up (:mod:`qkwatch.monitor.alerting.records`, each with the contract's alert record); it does
not import the store (which imports
:mod:`qkwatch.monitor.alerting` to evaluate the rules on ingest).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from qkwatch.contract.responses import AlertPublic
from qkwatch.monitor.alerting.records import PendingNotification
from qkwatch.monitor.alerting.webhooks import Policy, post

logger = logging.getLogger(__name__)

ZERO_TIME = "0001-01-01T00:00:00Z"


class Outbox(Protocol):
    """The notification outbox, as the notifier uses it (:class:`qkwatch.monitor.store.store.Store` is one)."""

    def claim_notifications(self, now: float) -> Sequence[PendingNotification]:
        """Claim the notifications due at ``now`` for delivery (a lease: no other replica sends them meanwhile)."""
        ...

    def finish_notification(
        self, nid: int, *, delivered: bool, error: str | None, next_try_at: float | None, give_up: bool, now: float
    ) -> None:
        """Record one delivery attempt of notification ``nid`` and release its claim."""
        ...


def _rfc3339(ts: float | None) -> str:
    if ts is None:
        return ZERO_TIME
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).isoformat().replace("+00:00", "Z")


def alert_labels(alert: AlertPublic) -> dict[str, str]:
    return {
        "alertname": alert.rule,
        "severity": alert.severity,
        "project": alert.project,
        "run": alert.run_name,
        "run_id": alert.run,
        "metric": alert.metric,
    }


def last_values_text(alert: AlertPublic) -> str:
    """``layer=value`` of the alert's metric at its run's end, comma-separated ("3=0.931,4=0.95");
    "" when they were not kept."""
    if alert.last_values is None:
        return ""
    return ",".join(f"{layer}={_value(v)}" for layer, v in zip(alert.layers, alert.last_values, strict=False))


def ended_summary(alert: AlertPublic) -> str:
    """The summary of an alert whose run ended while it fired: how and where, its last values, then its own summary."""
    at = "" if alert.ended_step is None else f" at step {alert.ended_step}"
    values = ""
    if alert.last_values is not None:
        pairs = zip(alert.layers, alert.last_values, strict=False)
        values = f"; last {alert.metric}: " + ", ".join(f"layer {layer} = {_value(v)}" for layer, v in pairs)
    return f"run ended while firing (run {alert.run_end or 'ended'}{at}{values}): {alert.summary}"


def _value(v: float | None) -> str:
    """A value as a webhook shows it: 4 significant digits; NaN and infinities as "nan", "inf", "-inf"."""
    return "-" if v is None else f"{v:.4g}"


def alertmanager_payload(n: PendingNotification, external_url: str, receiver: str = "qkwatch") -> dict[str, Any]:
    """The body Alertmanager posts to a webhook receiver (version 4), for one alert.

    An ``ended`` notification (the run ended while the alert fired) goes out as ``firing`` with the
    annotations ``run_ended``, ``ended_step`` and ``last_values`` (see the module docstring).
    """
    a = n.alert
    labels = alert_labels(a)
    status = "resolved" if n.status == "resolved" else "firing"
    annotations = {
        "summary": a.summary,
        "layers": ",".join(map(str, a.layers)),
        "onset_step": str(a.onset_step),
        "resolved_step": "" if a.resolved_step is None else str(a.resolved_step),
    }
    if a.predicted_step is not None:  # a forecast's alert: the crossing step it predicted
        annotations["predicted_step"] = str(a.predicted_step)
    if n.status == "ended":
        annotations |= {
            "summary": ended_summary(a),
            "run_ended": a.run_end or "ended",
            "ended_step": "" if a.ended_step is None else str(a.ended_step),
            "last_values": last_values_text(a),
        }
    item = {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": _rfc3339(a.starts_at_s),
        "endsAt": _rfc3339(a.ends_at_s if status == "resolved" else None),
        "generatorURL": f"{external_url.rstrip('/')}/?run={a.run}",
        "fingerprint": hashlib.sha256(f"{a.id}".encode()).hexdigest()[:16],
    }
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{a.rule}", run="{a.run_name}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": {"alertname": a.rule, "run": a.run_name},
        "commonLabels": labels,
        "commonAnnotations": item["annotations"],
        "externalURL": external_url,
        "alerts": [item],
    }


class Notifier:
    """Sends due notifications; ``deliver_pending`` is called by the maintenance thread (or a test)."""

    def __init__(
        self,
        store: Outbox,
        urls: Sequence[str],
        *,
        max_attempts: int = 8,
        policy: Policy | None = None,
        external_url: str = "",
        backoff_s: float = 2.0,
        max_backoff_s: float = 300.0,
    ) -> None:
        self.store = store
        self.urls = list(urls)
        self.max_attempts = max_attempts
        self.policy = policy or Policy()
        self.external_url = external_url
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._http = httpx.Client(timeout=self.policy.timeout_s, follow_redirects=False)
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._http.close()

    def deliver_pending(self, now: float | None = None) -> int:
        """Send every due notification once; returns how many were delivered."""
        if not self.urls:
            return 0
        now = time.time() if now is None else now
        delivered = 0
        for n in self.store.claim_notifications(now):
            error = self._send(n)
            attempts = n.attempts + 1
            give_up = error is not None and attempts >= self.max_attempts
            retry_at = now + min(self.max_backoff_s, self.backoff_s * 2 ** (attempts - 1))
            self.store.finish_notification(
                n.id, delivered=error is None, error=error, next_try_at=retry_at, give_up=give_up, now=time.time()
            )
            delivered += error is None
            if give_up:
                logger.error(
                    "gave up notifying %s alert %d after %d attempts: %s", n.status, n.alert.id, attempts, error
                )
        return delivered

    def _send(self, n: PendingNotification) -> str | None:
        body = json.dumps(alertmanager_payload(n, self.external_url), separators=(",", ":")).encode()
        errors = [e for url in self.urls if (e := post(self._http, url, body, self.policy)) is not None]
        return "; ".join(errors) or None
