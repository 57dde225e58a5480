"""The alert evaluator: a batch's reports through the rules, inside the ingest transaction.

:func:`qkwatch.monitor.alerting.rules.evaluate` decides (pure); this module turns what it decided into
alerts and notifications and keeps the rules' state, all through an :class:`AlertLedger`. The
store implements the ledger over the ingest transaction's connection, so an alert, its
notification (an outbox row) and the streak that raised it commit with the batch, or not at all.

The state the store keeps per (rule, layer) is :class:`StoredState`: a layer is firing exactly
while it has an open alert, so "firing" is the alert's id, not a column of its own. Growth and
forecast rules keep their per-layer values (baseline, recent points) in ``memory``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from qkwatch.monitor.alerting.rules import LayerState, ReportValues, RuleSet, Transition, evaluate

StateKey = tuple[str, int]
"""(rule name, layer); layer -1 for a band rule."""


@dataclass(frozen=True)
class StoredState:
    """A rule's state on one layer as it is stored: its :class:`LayerState` and its open alert."""

    streak: int
    since_step: int | None
    attempt: int
    step: int
    band_layers: tuple[int, ...]
    alert_id: int | None
    """The firing alert of this rule and layer; None while it does not fire."""
    memory: dict[str, Any] | None = None
    """A growth or forecast rule's values for the layer (:attr:`LayerState.memory`); None for the others."""


class AlertLedger(Protocol):
    """What the evaluator needs of the store for one run, inside one transaction."""

    def load_states(self) -> dict[StateKey, StoredState]:
        """Every stored state of the run's rules."""
        ...

    def save_states(self, states: dict[StateKey, StoredState]) -> None:
        """Insert or replace these states."""
        ...

    def open_alert(self, t: Transition) -> int:
        """Record a new firing alert; returns its id."""
        ...

    def update_alert(self, alert_id: int, t: Transition) -> None:
        """A firing alert's layers and summary changed (a band grew or shrank)."""
        ...

    def resolve_alert(self, alert_id: int, t: Transition) -> None:
        """The alert stopped firing at ``t.step``."""
        ...

    def queue_notification(self, alert_id: int, status: str) -> None:
        """Queue a notification ("firing" or "resolved") of the alert for the webhooks."""
        ...

    def end_alert(self, alert_id: int, step: int | None, note: str) -> None:
        """A firing alert resolves because its run ended (at ``step``, its last); ``note`` says how."""
        ...


def reports_for(
    rules: RuleSet, attempt: int, layer_values: Iterable[tuple[int, Mapping[str, list[float | None]]]]
) -> list[ReportValues]:
    """The reports of a batch that carry a metric some rule looks at (pure)."""
    metrics = rules.metrics
    return [ReportValues(attempt, step, values) for step, values in layer_values if metrics & values.keys()]


def evaluate_batch(
    rules: RuleSet,
    ledger: AlertLedger,
    attempt: int,
    layer_values: Iterable[tuple[int, Mapping[str, list[float | None]]]],
) -> int:
    """Run a batch's reports ((step, metric -> value per layer) of ``attempt``) through the rules.

    Opens, updates and resolves alerts, queues their notifications and saves the states that
    changed, all through ``ledger``. Returns the number of notifications queued.
    """
    reports = reports_for(rules, attempt, layer_values)
    if not reports:
        return 0
    stored = ledger.load_states()
    state = {key: _layer_state(s) for key, s in stored.items()}
    alert_ids = {key: s.alert_id for key, s in stored.items()}
    # A shallow copy is enough: the rules replace a state's memory, never change it in place.
    before = {key: replace(s) for key, s in state.items()}
    queued = sum(_record(ledger, t, alert_ids) for t in evaluate(rules, state, reports))
    changed = {key: _stored_state(s, alert_ids.get(key)) for key, s in state.items() if before.get(key) != s}
    if changed:
        ledger.save_states(changed)
    return queued


def end_of_run(ledger: AlertLedger, step: int | None, status: str) -> int:
    """The run ended with ``status`` (finished, or crashed, stale included): nothing of it can fire
    any more, so each firing alert resolves at the run's last step with a note that the run ended,
    and each rule's streak starts over (a resumed run raises its alerts afresh). Prometheus does the
    same: an ended run leaves ``/metrics``. Returns the notifications queued."""
    stored = ledger.load_states()
    queued = 0
    changed = {}
    for key, s in stored.items():
        if s.alert_id is not None:
            ledger.end_alert(s.alert_id, step, f"closed: the run {status}")
            ledger.queue_notification(s.alert_id, "resolved")
            queued += 1
        if s.alert_id is not None or s.streak or s.since_step is not None:
            changed[key] = replace(s, streak=0, since_step=None, band_layers=(), alert_id=None)
    if changed:
        ledger.save_states(changed)
    return queued


def _record(ledger: AlertLedger, t: Transition, alert_ids: dict[StateKey, int | None]) -> int:
    """Record one transition through the ledger; returns the notifications queued (0 or 1)."""
    alert_id: int | None
    if t.kind == "firing":
        alert_id = alert_ids[t.state_key] = ledger.open_alert(t)
    else:
        alert_id = alert_ids.get(t.state_key)
        if alert_id is None:
            return 0
        if t.kind == "update":
            ledger.update_alert(alert_id, t)
            return 0
        ledger.resolve_alert(alert_id, t)
        alert_ids[t.state_key] = None
    ledger.queue_notification(alert_id, t.kind)
    return 1


def _layer_state(s: StoredState) -> LayerState:
    return LayerState(
        streak=s.streak,
        since_step=s.since_step,
        firing=s.alert_id is not None,
        attempt=s.attempt,
        step=s.step,
        band_layers=s.band_layers,
        memory=copy.deepcopy(s.memory),
    )


def _stored_state(s: LayerState, alert_id: int | None) -> StoredState:
    return StoredState(
        streak=s.streak,
        since_step=s.since_step,
        attempt=s.attempt,
        step=s.step,
        band_layers=s.band_layers,
        alert_id=alert_id,
        memory=s.memory,
    )
