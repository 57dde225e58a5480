"""The alert evaluator: a batch's reports through the rules, inside the ingest transaction.

:func:`qkwatch.rules.transitions.evaluate` decides (pure); this module turns what it decided into
alerts and notifications and keeps the rules' state, all through an :class:`AlertLedger`. The
store implements the ledger over the ingest transaction's connection, so an alert, its
notification (an outbox row) and the streak that raised it commit with the batch, or not at all.

The state the store keeps per (rule, layer) is :class:`StoredState`: a layer is firing exactly
while it has an alert, so "firing" is the alert's id, not a column of its own. Growth and
forecast rules keep their per-layer values (baseline, recent points) in ``memory``.

When a run ends while an alert fires (:func:`end_of_run`), nothing has resolved it: the alert is
kept in state ``ended`` ("run ended while firing") with the run's last step and its last values,
and an ``ended`` notification is queued. The rule keeps holding the layer as firing, so a run that
resumes (a new attempt, or reports after it was marked stale) carries on where it stopped: its
first report that the rule judges re-opens the same alert (``firing`` again, a ``firing``
notification) while the condition still holds, or resolves it (a ``resolved`` notification) once it
no longer does. One alert, one incident, however often the run stops and resumes.

Reports that reach a run after its end without resuming it (another rank's last reports, delivered
after rank 0 said the run finished) are judged too, but cannot make it look alive again
(:class:`RunEnd`): an ended alert stays ended, and a layer they make fire gets its alert already
ended, with one ``ended`` notification.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import LayerState, ReportValues, Transition, evaluate

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
    """The alert this rule and layer fire under; None while it does not fire."""
    memory: dict[str, Any] | None = None
    """A growth or forecast rule's values for the layer (:attr:`LayerState.memory`); None for the others."""
    alert_ended: bool = False
    """The alert ended with its run while it fired (state ``ended``); the next report of the resumed
    run re-opens or resolves it. The store reads this from the alert itself."""


@dataclass(frozen=True)
class RunEnd:
    """The run a batch belongs to has ended and stays ended (the batch does not resume it)."""

    step: int | None
    """Its last step."""
    how: str
    """How it ended: "finished", "crashed" or "stale"."""


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
        """The alert (firing, or ended with its run) stopped firing at ``t.step``."""
        ...

    def queue_notification(self, alert_id: int, status: str) -> None:
        """Queue a notification ("firing", "resolved" or "ended") of the alert for the webhooks."""
        ...

    def end_alert(self, alert_id: int, step: int | None, how: str) -> None:
        """The alert's run ended while it fired, at ``step`` (its last), ``how`` being "finished",
        "crashed" or "stale": the alert becomes ``ended`` and keeps the metric's last values."""
        ...

    def reopen_alert(self, alert_id: int) -> None:
        """An ended alert fires again: its run resumed and the condition still holds."""
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
    run_end: RunEnd | None = None,
) -> int:
    """Run a batch's reports ((step, metric -> value per layer) of ``attempt``) through the rules.

    Opens, updates and resolves alerts, queues their notifications and saves the states that
    changed, all through ``ledger``. With ``run_end`` (the run ended and the batch does not resume
    it) no ended alert fires again, and an alert that opens is ended at once. Returns the number of
    notifications queued.
    """
    reports = reports_for(rules, attempt, layer_values)
    if not reports:
        return 0
    stored = ledger.load_states()
    state = {key: _layer_state(s) for key, s in stored.items()}
    alert_ids = {key: s.alert_id for key, s in stored.items()}
    ended = {key for key, s in stored.items() if s.alert_ended and s.alert_id is not None}
    # A shallow copy is enough: the rules replace a state's memory, never change it in place.
    before = {key: replace(s) for key, s in state.items()}
    queued = sum(_record(ledger, t, alert_ids, ended, run_end) for t in evaluate(rules, state, reports))
    # An ended alert whose rule judged a report of the resumed run and still holds fires again.
    for key in [k for k in ended if run_end is None and state[k].firing and state[k] != before[k]]:
        queued += _reopen(ledger, key, alert_ids[key], ended)
    changed = {
        key: _stored_state(s, alert_ids.get(key), key in ended) for key, s in state.items() if before.get(key) != s
    }
    if changed:
        ledger.save_states(changed)
    return queued


def end_of_run(ledger: AlertLedger, step: int | None, how: str) -> int:
    """The run ended at ``step`` (its last), ``how`` being "finished", "crashed" or "stale".

    Nothing resolved its firing alerts, so none is shown as resolved: each becomes ``ended`` ("run
    ended while firing"), keeps the metric's last values and queues an ``ended`` notification
    (once: ending a run again only updates how and where it ended). The rules keep holding those
    layers as firing, so a resumed run re-opens or resolves the same alert on its next report (see
    the module docstring). A streak that had not fired yet starts over: a resume may go back to an
    earlier checkpoint. Returns the notifications queued.
    """
    stored = ledger.load_states()
    queued = 0
    changed = {}
    for key, s in stored.items():
        if s.alert_id is not None:
            ledger.end_alert(s.alert_id, step, how)
            if not s.alert_ended:
                ledger.queue_notification(s.alert_id, "ended")
                queued += 1
                changed[key] = replace(s, alert_ended=True)
        elif s.streak or s.since_step is not None:
            changed[key] = replace(s, streak=0, since_step=None, band_layers=())
    if changed:
        ledger.save_states(changed)
    return queued


def _record(
    ledger: AlertLedger,
    t: Transition,
    alert_ids: dict[StateKey, int | None],
    ended: set[StateKey],
    run_end: RunEnd | None,
) -> int:
    """Record one transition through the ledger; returns the notifications queued (0, 1 or 2)."""
    alert_id: int | None
    if t.kind == "firing":
        alert_id = alert_ids[t.state_key] = ledger.open_alert(t)
        if run_end is not None:  # it fired after the end: the run ended while it fired
            ledger.end_alert(alert_id, run_end.step, run_end.how)
            ended.add(t.state_key)
            ledger.queue_notification(alert_id, "ended")
            return 1
    else:
        alert_id = alert_ids.get(t.state_key)
        if alert_id is None:
            return 0
        if t.kind == "update":
            resumed = t.state_key in ended and run_end is None
            queued = _reopen(ledger, t.state_key, alert_id, ended) if resumed else 0
            ledger.update_alert(alert_id, t)
            return queued
        ledger.resolve_alert(alert_id, t)  # an ended alert too: the resumed run healed
        ended.discard(t.state_key)
        alert_ids[t.state_key] = None
    ledger.queue_notification(alert_id, t.kind)
    return 1


def _reopen(ledger: AlertLedger, key: StateKey, alert_id: int | None, ended: set[StateKey]) -> int:
    """An ended alert fires again (its run resumed, still in trouble); returns the notifications queued."""
    assert alert_id is not None
    ledger.reopen_alert(alert_id)
    ended.discard(key)
    ledger.queue_notification(alert_id, "firing")
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


def _stored_state(s: LayerState, alert_id: int | None, alert_ended: bool) -> StoredState:
    return StoredState(
        streak=s.streak,
        since_step=s.since_step,
        attempt=s.attempt,
        step=s.step,
        band_layers=s.band_layers,
        alert_id=alert_id,
        memory=s.memory,
        alert_ended=alert_ended,
    )
