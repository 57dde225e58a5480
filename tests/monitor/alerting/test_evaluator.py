"""The evaluator: rules' transitions -> alerts, notifications and stored state, through a ledger.

The ledger here is an in-memory double of the store's (``monitor.store.runs.alerts.AlertRows``, which
``tests/monitor/store/test_alert_rows.py`` runs on both databases), so each test sees exactly
what the evaluator asked the store to write.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from qkwatch.rules.evaluator import (
    AlertLedger,
    StateKey,
    StoredState,
    end_of_run,
    evaluate_batch,
    reports_for,
)
from qkwatch.rules.kinds import ForecastRule, GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import Transition


class MemoryLedger:
    """An :class:`AlertLedger` in memory; it records every call."""

    def __init__(self, states: dict[StateKey, StoredState] | None = None) -> None:
        self.states = dict(states or {})
        self.alerts: dict[int, dict] = {}
        self.notifications: list[tuple[int, str]] = []
        self.saved: list[dict[StateKey, StoredState]] = []
        self.loads = 0
        self.opened: list[Transition] = []

    def save_states(self, states: dict[StateKey, StoredState]) -> None:
        self.saved.append(states)
        self.states.update(states)

    def open_alert(self, t: Transition) -> int:
        self.opened.append(t)
        alert_id = 100 + len(self.alerts)
        self.alerts[alert_id] = {"rule": t.rule, "state": "firing", "layers": t.layers, "onset": t.onset_step}
        return alert_id

    def update_alert(self, alert_id: int, t: Transition) -> None:
        self.alerts[alert_id]["layers"] = t.layers

    def resolve_alert(self, alert_id: int, t: Transition) -> None:
        self.alerts[alert_id].update(state="resolved", layers=t.layers, resolved=t.step)
        for key in ("ended", "how"):  # as the store: a resolved alert says nothing of an end
            self.alerts[alert_id].pop(key, None)

    def queue_notification(self, alert_id: int, status: str) -> None:
        self.notifications.append((alert_id, status))

    def end_alert(self, alert_id: int, step: int | None, how: str) -> None:
        self.alerts[alert_id].update(state="ended", ended=step, how=how)

    def reopen_alert(self, alert_id: int) -> None:
        a = self.alerts[alert_id]
        assert a["state"] == "ended", a  # only an ended alert is re-opened
        a["state"] = "firing"
        del a["ended"], a["how"]

    def load_states(self) -> dict[StateKey, StoredState]:
        """As the store: whether a state's alert ended is read from the alert itself."""
        self.loads += 1
        return {
            k: replace(
                s, alert_ended=s.alert_id is not None and self.alerts.get(s.alert_id, {}).get("state") == "ended"
            )
            for k, s in self.states.items()
        }


def qkai(start: int, rows: list[list[float | None]]) -> list[tuple[int, dict[str, list[float | None]]]]:
    """(step, metric -> values) per report, one step apart from ``start``."""
    return [(start + i, {"qkai": row}) for i, row in enumerate(rows)]


def test_the_memory_ledger_is_a_ledger() -> None:
    ledger: AlertLedger = MemoryLedger()  # a type checker holds the double to the protocol
    assert ledger.load_states() == {}


def test_reports_without_a_rule_metric_touch_nothing() -> None:
    ledger = MemoryLedger()
    assert evaluate_batch(RuleSet.default(), ledger, 1, [(0, {"loss": [1.0]}), (1, {})]) == 0
    assert ledger.loads == 0 and ledger.saved == [] and ledger.alerts == {}


def test_reports_for_keeps_the_reports_a_threshold_rule_reads() -> None:
    rules = RuleSet((ThresholdRule("low", metric="attn_entropy", op="<"),), ())
    out = reports_for(rules, 2, [(0, {"qkai": [0.9]}), (1, {"attn_entropy": [0.1]})])
    assert [(r.attempt, r.step, dict(r.layers)) for r in out] == [(2, 1, {"attn_entropy": [0.1]})]


def test_a_firing_rule_opens_an_alert_queues_a_notification_and_stores_its_id() -> None:
    ledger = MemoryLedger()
    assert evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.1]] * 3)) == 1
    assert ledger.alerts == {100: {"rule": "qkai_high", "state": "firing", "layers": (0,), "onset": 0}}
    assert ledger.notifications == [(100, "firing")]
    assert ledger.states[("qkai_high", 0)] == StoredState(3, 0, 1, 2, (), 100)
    assert ledger.states[("qkai_high", 1)] == StoredState(0, None, 1, 2, (), None)


def test_a_stored_alert_id_is_a_firing_layer_that_resolves() -> None:
    ledger = MemoryLedger({("qkai_high", 0): StoredState(5, 10, 1, 14, (), 7)})
    ledger.alerts[7] = {"rule": "qkai_high", "state": "firing", "layers": (0,), "onset": 10}
    assert evaluate_batch(RuleSet.default(), ledger, 1, qkai(15, [[0.2]])) == 1
    assert ledger.alerts[7] == {"rule": "qkai_high", "state": "resolved", "layers": (0,), "onset": 10, "resolved": 15}
    assert ledger.notifications == [(7, "resolved")]
    assert ledger.states[("qkai_high", 0)] == StoredState(0, None, 1, 15, (), None)


def test_the_end_of_a_run_ends_its_firing_alerts_and_restarts_the_streaks_that_had_not_fired() -> None:
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.9, 0.1]] * 3))  # layers 0, 1 fire
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(3, [[0.9, 0.9, 0.8]]))  # layer 2: a streak of 1
    firing = sorted(ledger.alerts)
    assert len(firing) == 2 and ledger.notifications == [(a, "firing") for a in firing]
    assert end_of_run(ledger, 3, "finished") == 2
    assert [(ledger.alerts[a]["state"], ledger.alerts[a]["ended"]) for a in firing] == [("ended", 3)] * 2
    assert "resolved" not in {a["state"] for a in ledger.alerts.values()}  # nothing resolved them
    assert {ledger.alerts[a]["how"] for a in firing} == {"finished"}
    assert ledger.notifications[2:] == [(a, "ended") for a in firing]
    # the rules still hold layers 0 and 1 firing, under the same alerts; layer 2's streak starts over
    assert [ledger.states[("qkai_high", i)].alert_id for i in (0, 1)] == firing
    assert all(ledger.states[("qkai_high", i)].alert_ended for i in (0, 1))
    assert ledger.states[("qkai_high", 2)] == StoredState(0, None, 1, 3, (), None)
    assert end_of_run(ledger, 3, "finished") == 0  # idempotent: each end is told once
    assert len(ledger.notifications) == 4


def test_ending_again_updates_how_the_run_ended_without_a_second_notification() -> None:
    """Marked stale, then the agent's own end arrives: the alert says how the run really ended."""
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9]] * 3))
    assert end_of_run(ledger, 2, "stale") == 1
    assert end_of_run(ledger, 2, "finished") == 0
    assert (ledger.alerts[100]["state"], ledger.alerts[100]["how"]) == ("ended", "finished")
    assert ledger.notifications == [(100, "firing"), (100, "ended")]


def test_a_resumed_run_still_in_trouble_reopens_the_same_alert() -> None:
    """The run went stale with layer 0 firing; it reports again (same attempt) and layer 0 still holds:
    the same alert fires again, with a firing notification; no second alert is opened."""
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.2]] * 3))
    end_of_run(ledger, 2, "stale")
    assert evaluate_batch(RuleSet.default(), ledger, 1, qkai(3, [[0.95, 0.2]])) == 1
    assert ledger.alerts == {100: {"rule": "qkai_high", "state": "firing", "layers": (0,), "onset": 0}}
    assert ledger.notifications == [(100, "firing"), (100, "ended"), (100, "firing")]
    assert ledger.states[("qkai_high", 0)] == StoredState(4, 0, 1, 3, (), 100)
    assert evaluate_batch(RuleSet.default(), ledger, 1, qkai(4, [[0.95, 0.2]])) == 0  # firing on: nothing new


def test_a_new_attempt_that_healed_resolves_the_ended_alert() -> None:
    """Attempt 2 resumes from an earlier checkpoint and the layer is below the threshold: the alert
    that ended with attempt 1 resolves at attempt 2's first report (the receiver's incident closes)."""
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(10, [[0.9]] * 3))
    end_of_run(ledger, 12, "crashed")
    assert evaluate_batch(RuleSet.default(), ledger, 2, qkai(5, [[0.4]])) == 1
    assert ledger.alerts[100] == {"rule": "qkai_high", "state": "resolved", "layers": (0,), "onset": 10, "resolved": 5}
    assert ledger.notifications == [(100, "firing"), (100, "ended"), (100, "resolved")]
    assert ledger.states[("qkai_high", 0)] == StoredState(0, None, 2, 5, (), None)


def test_a_band_that_ended_reopens_with_its_new_layers() -> None:
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.9, 0.9, 0.1]] * 3))
    band = next(i for i, a in ledger.alerts.items() if a["rule"] == "collapse_band")
    end_of_run(ledger, 2, "crashed")
    assert all(a["state"] == "ended" for a in ledger.alerts.values())
    sent = len(ledger.notifications)
    evaluate_batch(RuleSet.default(), ledger, 2, qkai(3, [[0.9, 0.9, 0.9, 0.9]] * 3))  # the band grows
    assert (ledger.alerts[band]["state"], ledger.alerts[band]["layers"]) == ("firing", (0, 1, 2, 3))
    assert [n for n in ledger.notifications[sent:] if n[0] == band] == [(band, "firing")]  # re-opened once
    assert [a["rule"] for a in ledger.alerts.values()].count("collapse_band") == 1


def test_an_ended_alert_whose_rule_judges_nothing_stays_ended() -> None:
    """A resumed run's report without the layer (or its rule's metric) leaves the ended alert as it is."""
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.2]] * 3))
    end_of_run(ledger, 2, "stale")
    assert evaluate_batch(RuleSet.default(), ledger, 1, [(3, {"loss": [1.0]}), (4, {"qkai": [None, 0.2]})]) == 0
    assert ledger.alerts[100]["state"] == "ended"


def test_a_band_that_grows_updates_its_alert_without_a_notification() -> None:
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.9, 0.9, 0.1]] * 3))
    band = next(i for i, a in ledger.alerts.items() if a["rule"] == "collapse_band")
    assert ledger.alerts[band]["layers"] == (0, 1, 2)
    sent = len(ledger.notifications)
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(3, [[0.9, 0.9, 0.9, 0.9]] * 3))
    assert ledger.alerts[band]["layers"] == (0, 1, 2, 3)
    assert [n for n in ledger.notifications[sent:] if n[0] == band] == []  # only layer 3's own alert fired
    assert ledger.states[("collapse_band", -1)].band_layers == (0, 1, 2, 3)


def test_a_replayed_batch_saves_and_queues_nothing() -> None:
    ledger = MemoryLedger()
    batch = qkai(0, [[0.9]] * 3)
    evaluate_batch(RuleSet.default(), ledger, 1, batch)
    saves = len(ledger.saved)
    assert evaluate_batch(RuleSet.default(), ledger, 1, batch) == 0
    assert len(ledger.saved) == saves and ledger.notifications == [(100, "firing")]


def test_only_changed_states_are_saved() -> None:
    ledger = MemoryLedger()
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(0, [[0.9, 0.1]]))
    evaluate_batch(RuleSet.default(), ledger, 1, qkai(1, [[0.9, None]]))  # layer 1 not measured
    assert set(ledger.saved[-1]) == {("qkai_high", 0), ("collapse_band", -1)}


class JsonLedger(MemoryLedger):
    """A :class:`MemoryLedger` that keeps each state's memory as JSON text, as the store does (so no
    dict is shared between batches but what the text holds)."""

    def save_states(self, states: dict[StateKey, StoredState]) -> None:
        super().save_states({k: replace(s, memory=json.dumps(s.memory)) for k, s in states.items()})

    def load_states(self) -> dict[StateKey, StoredState]:
        return {k: replace(s, memory=json.loads(s.memory)) for k, s in super().load_states().items()}


DETECTORS = RuleSet(
    thresholds=(ThresholdRule("qkai_high", threshold=0.7),),
    bands=(),
    growths=(GrowthRule("logit_growth", factor=2.0, baseline_reports=2, for_reports=1),),
    forecasts=(ForecastRule("qkai_forecast", horizon_steps=40, window=3),),
)


def rising(n: int) -> list[tuple[int, dict[str, list[float | None]]]]:
    """QKAI 0.5 + 0.01 per step (crosses 0.70 at step 20) and logit_max 4 + 0.5 per step, one layer, steps 0..n-1."""
    return [(s, {"qkai": [0.5 + 0.01 * s], "logit_max": [4.0 + 0.5 * s]}) for s in range(n)]


def test_growth_and_forecast_memory_goes_through_the_ledger() -> None:
    ledger = JsonLedger()
    assert evaluate_batch(DETECTORS, ledger, 1, rising(3)) == 1  # the forecast: 3 points, crossing at 20
    assert json.loads(ledger.states[("logit_growth", 0)].memory) == {"skipped": 0, "early": [4.0, 4.5]}
    points = json.loads(ledger.states[("qkai_forecast", 0)].memory)["points"]
    assert [x for x, _ in points] == [0, 1, 2]
    assert json.loads(ledger.states[("qkai_high", 0)].memory) is None
    [opened] = ledger.opened
    assert (opened.rule, opened.step, opened.predicted_step) == ("qkai_forecast", 2, 20)


@pytest.mark.parametrize("size", [1, 2, 5, 7])
def test_batches_through_a_stored_state_give_what_one_batch_gives(size: int) -> None:
    whole = MemoryLedger()
    evaluate_batch(DETECTORS, whole, 1, rising(30))
    pieces = JsonLedger()
    reports = rising(30)
    for lo in range(0, 30, size):
        evaluate_batch(DETECTORS, pieces, 1, reports[lo : lo + size])
    assert pieces.alerts == whole.alerts and pieces.notifications == whole.notifications
    assert [(t.rule, t.step, t.predicted_step, t.summary) for t in pieces.opened] == [
        (t.rule, t.step, t.predicted_step, t.summary) for t in whole.opened
    ]
    assert {t.rule for t in whole.opened} == {"qkai_forecast", "logit_growth", "qkai_high"}
