"""Backtests: stored runs replayed through alert rules, each rule's first firing scored against the run's outcome.

``qkwatch alerts backtest`` and the experiments that score detectors across many runs use it (the scores
over runs: :mod:`qkwatch.client.backtest_scores`).
:func:`qkwatch.client.run_history.read` takes a run from a collector over REST into a
:class:`~qkwatch.client.run_history.RunHistory`; everything here is pure and takes histories as
data, so a history may also be built by hand.

**The replay is the collector's own code.** Each report goes through
:func:`qkwatch.rules.evaluator.evaluate_batch` (and so through
:func:`qkwatch.rules.transitions.evaluate`) as a batch of its own, in (attempt, step) order,
against an in-memory :class:`~qkwatch.rules.evaluator.AlertLedger`: the rule state
round-trips through the ledger between reports exactly as it does through the store between
batches, so a rule kind the collector can evaluate is replayed without this module knowing of
it. A report's values are the stored per-layer values of that step (NaN as NaN, which breaks a
streak; not measured as None, which is skipped), as the ingest hands them to the rules. When an
attempt gives way to the next, the run ends first (:func:`~qkwatch.rules.evaluator.end_of_run`):
live, a run is marked crashed (by the agent, or as stale) before it resumes: an alert firing then
carries on into the next attempt (re-opened, not opened again) while its condition holds, and
the streaks that had not fired start over. A rule's *first firing step* is the step of the
report at which the collector opened its first alert (a band's alert, or any layer's); its
*onset step* is where the condition began to hold (the alert's ``onset_step``).

The replay can differ from what a collector did at the time in three ways, none of which a
history records: the collector ran other rules or another collapse threshold; a batch arrived
after a later one (the collector's rules skip reports older than one they have seen; the
replay takes every stored report in order); or a run resumed before the collector saw it end.

**Scoring.** The outcome is :func:`qkwatch.client.outcomes.label` of the run's ``loss`` scalar
(the merged view over attempts: per step the latest attempt's value): ``diverged``, ``spiked`` or
``healthy``, or ``unknown`` when no loss was logged. For a run that went bad,
``lead_steps = outcome_step - first_fire_step`` (negative when the rule fired late) and
``lead_reports`` counts the reports from the firing up to, not including, the outcome's step
(negative: the reports from the outcome up to the firing). A rule that fires on a healthy run
raised a false alarm; its leads are None, as they are when it never fired.

**Degraded, against a twin.** Given a reference run (:class:`Judging`: the same recipe at a setting
that went well), a run that did not diverge is ``degraded`` when its final held-out loss (the mean of
its last ``k`` ``val_loss`` values) is at least ``delta`` above the reference's
(:func:`qkwatch.client.outcomes.judge`); its outcome step is its last logged step, where a user
comparing final losses learns of it. A run without ``val_loss`` is judged by its loss alone, and says so.

**Against the loss.** Each run is also replayed through a loss-only alert
(:mod:`qkwatch.rules.loss_rules`; by default the one tuned on the instability suite's tune
recipe, :data:`~qkwatch.rules.loss_rules.TUNED_BASELINE`): the step a user watching only the loss
would have been told. A rule's ``lead_vs_loss`` on a bad run it flagged (first fired at or before
the outcome's step) is that step (the outcome's, if the loss alert had not fired by then) minus
the rule's first firing: what qkwatch adds over the loss. The loss alert is scored beside the
rules as a row of its own (:data:`LOSS_ROW`), and false alarms are counted per healthy run.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from qkwatch.client.outcomes import SUITE_DELTA, Degradation, OutcomeRule, final_heldout, judge, label
from qkwatch.client.run_history import RunHistory
from qkwatch.rules.evaluator import StateKey, StoredState, end_of_run, evaluate_batch
from qkwatch.rules.loss_rules import TUNED_BASELINE, LossRule, LossSeries
from qkwatch.rules.ruleset import RuleSet
from qkwatch.rules.transitions import ReportValues, Transition

if TYPE_CHECKING:
    pass

OutcomeLabel = Literal["diverged", "spiked", "degraded", "healthy", "unknown"]
BAD: frozenset[str] = frozenset({"diverged", "spiked", "degraded"})
"""The outcomes a rule should warn of."""
ANY_RULE = "(any rule)"
"""The summary row of the rules together: a run is flagged at its earliest firing of any rule."""
LOSS_ROW = "(loss only)"
"""The row of the loss-only alert, scored like a rule (not part of :data:`ANY_RULE`)."""


# ---- the replay ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Firing:
    """An alert the collector would have opened."""

    rule: str
    attempt: int
    step: int
    """The report at which it fired."""
    onset_step: int
    """Where its condition began to hold (the alert's ``onset_step``)."""
    layers: tuple[int, ...]
    summary: str
    predicted_step: int | None = None
    """A forecast's predicted crossing step when it fired (None for the other kinds)."""


class _Ledger:
    """An :class:`~qkwatch.rules.evaluator.AlertLedger` in memory that keeps the alerts opened."""

    def __init__(self) -> None:
        self.states: dict[StateKey, StoredState] = {}
        self.opened: list[Firing] = []
        self.attempt = 0

    def load_states(self) -> dict[StateKey, StoredState]:
        return dict(self.states)

    def save_states(self, states: dict[StateKey, StoredState]) -> None:
        self.states.update(states)

    def open_alert(self, t: Transition) -> int:
        self.opened.append(Firing(t.rule, self.attempt, t.step, t.onset_step, t.layers, t.summary, t.predicted_step))
        return len(self.opened)

    def update_alert(self, alert_id: int, t: Transition) -> None:
        """A band's layers changed: not a new firing."""

    def resolve_alert(self, alert_id: int, t: Transition) -> None:
        """Resolutions are not scored."""

    def queue_notification(self, alert_id: int, status: str) -> None:
        """Nothing is sent."""

    def end_alert(self, alert_id: int, step: int | None, how: str) -> None:
        """The run ended before the next attempt (see :func:`replay`)."""

    def reopen_alert(self, alert_id: int) -> None:
        """The next attempt carries an ended alert on: not a new firing."""


def replay(rules: RuleSet, reports: Iterable[ReportValues]) -> list[Firing]:
    """Every alert the collector would have opened over ``reports``, in order (see the module docstring)."""
    ledger = _Ledger()
    last: ReportValues | None = None
    for report in sorted(reports, key=lambda r: (r.attempt, r.step)):
        if last is not None and report.attempt != last.attempt:
            end_of_run(ledger, last.step, "crashed")  # it resumed as a new attempt
        ledger.attempt = report.attempt
        evaluate_batch(rules, ledger, report.attempt, [(report.step, report.layers)])
        last = report
    return ledger.opened


def rule_names(rules: RuleSet) -> list[str]:
    """Every rule's name, whatever its kind: the named items of each of the rule set's tuples."""
    names: list[str] = []
    for f in dataclasses.fields(rules):
        value = getattr(rules, f.name)
        if isinstance(value, tuple):
            names += [name for item in value if isinstance(name := getattr(item, "name", None), str)]
    return list(dict.fromkeys(names))


# ---- scoring ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleResult:
    """One rule on one run."""

    rule: str
    first_fire_step: int | None
    """The step of the report at which it first fired; None: it never fired."""
    lead_steps: int | None
    """``outcome_step - first_fire_step`` on a run that went bad (negative: late); else None."""
    lead_reports: int | None
    """Reports from the firing up to the outcome's step (negative: from the outcome up to the firing); else None."""
    lead_vs_loss: int | None = None
    """On a bad run it flagged (fired at or before the outcome's step): the loss-only alert's first firing
    (the outcome's step when it had not fired by then) minus this rule's; else None."""
    onset_step: int | None = None
    attempt: int | None = None
    layers: tuple[int, ...] = ()
    """The layers of its first alert."""
    firings: int = 0
    """Alerts it opened over the whole run (each layer's count for a per-layer rule)."""
    summary: str | None = None
    """Its first alert's summary."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "first_fire_step": self.first_fire_step,
            "lead_steps": self.lead_steps,
            "lead_reports": self.lead_reports,
            "lead_vs_loss": self.lead_vs_loss,
            "onset_step": self.onset_step,
            "attempt": self.attempt,
            "layers": list(self.layers),
            "firings": self.firings,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class RunBacktest:
    """One run: its outcome and each rule's first firing and lead."""

    run: str
    outcome: OutcomeLabel
    outcome_step: int | None
    why: str
    reports: int
    """Reports replayed (distinct steps with per-layer values)."""
    rules: tuple[RuleResult, ...]
    loss_step: int | None = None
    """The step at which the loss-only alert first fired (None: never, or no loss)."""
    final: float | None = None
    """The final held-out loss (None: no ``val_loss`` logged, or not finite)."""

    @property
    def false_alarm(self) -> bool:
        """A rule fired on a run that stayed healthy."""
        return self.outcome == "healthy" and any(r.firings for r in self.rules if r.rule != LOSS_ROW)

    def rule(self, name: str) -> RuleResult:
        return next(r for r in self.rules if r.rule == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "outcome": self.outcome,
            "outcome_step": self.outcome_step,
            "why": self.why,
            "reports": self.reports,
            "false_alarm": self.false_alarm,
            "loss_step": self.loss_step,
            "final": self.final,
            "rules": [r.to_json() for r in self.rules],
        }


@dataclass(frozen=True)
class Judging:
    """How runs are judged beyond their loss's own spikes, and the loss-only alert they are compared with."""

    outcome_rule: OutcomeRule = field(default_factory=OutcomeRule)
    reference: RunHistory | None = None
    """The twin a run is judged degraded against (None: spikes and divergence only)."""
    delta: float = SUITE_DELTA
    """Nats of final held-out loss above the reference's that make a run degraded."""
    k: int = 3
    """Held-out evaluations averaged at the end of a run."""
    loss_alert: LossRule | None = TUNED_BASELINE
    """The loss-only alert of the lead over the loss (None: no comparison)."""

    def __post_init__(self) -> None:
        Degradation(self.delta, self.k)  # ValueError names a bad delta or k

    def reference_final(self) -> float | None:
        """The reference's final held-out loss; None without a reference."""
        return None if self.reference is None else final_heldout(self.reference.val_losses, self.k)


def backtest(
    history: RunHistory, rules: RuleSet, outcome_rule: OutcomeRule | None = None, judging: Judging | None = None
) -> RunBacktest:
    """Replay ``history`` through ``rules`` and score each rule's first firing against the run's outcome.

    ``judging`` adds the degraded outcome against a reference and the lead over a loss-only alert
    (its ``outcome_rule`` gives way to ``outcome_rule`` when that is given)."""
    judging = judging or Judging()
    if outcome_rule is not None:
        judging = dataclasses.replace(judging, outcome_rule=outcome_rule)
    outcome, outcome_step, why = _outcome(history, judging)
    firings = replay(rules, history.reports)
    steps = sorted({r.step for r in history.reports})
    names = list(dict.fromkeys([*rule_names(rules), *(f.rule for f in firings)]))
    bad_step = outcome_step if outcome in BAD else None
    loss_step = _loss_step(history, judging.loss_alert)
    results = [_result(name, [f for f in firings if f.rule == name], bad_step, steps, loss_step) for name in names]
    if judging.loss_alert is not None and history.losses:
        results.append(_loss_result(judging.loss_alert, loss_step, bad_step, steps))
    final = final_heldout(history.val_losses, judging.k) if history.val_losses else None
    final = final if final is not None and math.isfinite(final) else None
    return RunBacktest(history.run, outcome, outcome_step, why, len(steps), tuple(results), loss_step, final)


def _outcome(history: RunHistory, judging: Judging) -> tuple[OutcomeLabel, int | None, str]:
    if not history.losses:
        return "unknown", None, "no training loss was logged (the outcome is read from the run's loss scalar)"
    reference = judging.reference_final()
    spikes = label(history.loss_steps, history.losses, judging.outcome_rule)
    if reference is None or judging.reference is None or history.run == judging.reference.run:
        return spikes.label, spikes.step, spikes.why
    if not history.val_losses:
        return spikes.label, spikes.step, f"{spikes.why}; no val_loss logged, so not judged against the reference"
    o = judge(
        history.loss_steps,
        history.losses,
        final_heldout(history.val_losses, judging.k),
        reference,
        Degradation(judging.delta, judging.k),
        judging.outcome_rule,
        visible=history.loss_steps[-1],
    )
    return o.label, o.step, o.why


def _loss_step(history: RunHistory, rule: LossRule | None) -> int | None:
    if rule is None or not history.losses:
        return None
    return LossSeries(history.loss_steps, history.losses).first_firing(rule, history.loss_steps[-1] + 1)


def _loss_result(rule: LossRule, loss_step: int | None, bad_step: int | None, steps: list[int]) -> RuleResult:
    if loss_step is None:
        return RuleResult(LOSS_ROW, None, None, None, summary=rule.text())
    lead = None if bad_step is None else bad_step - loss_step
    reports = None if bad_step is None else lead_reports(steps, loss_step, bad_step)
    vs_itself = 0 if bad_step is not None and loss_step <= bad_step else None
    return RuleResult(LOSS_ROW, loss_step, lead, reports, vs_itself, None, None, (), 1, rule.text())


def _result(
    name: str, firings: list[Firing], bad_step: int | None, steps: list[int], loss_step: int | None = None
) -> RuleResult:
    if not firings:
        return RuleResult(name, None, None, None)
    first = min(firings, key=lambda f: (f.attempt, f.step))
    lead = None if bad_step is None else bad_step - first.step
    vs_loss = None
    if bad_step is not None and first.step <= bad_step:
        vs_loss = min(loss_step if loss_step is not None else bad_step, bad_step) - first.step
    return RuleResult(
        name,
        first.step,
        lead,
        None if bad_step is None else lead_reports(steps, first.step, bad_step),
        vs_loss,
        first.onset_step,
        first.attempt,
        first.layers,
        len(firings),
        first.summary,
    )


def lead_reports(steps: Sequence[int], fire_step: int, outcome_step: int) -> int:
    """Report steps in ``[fire_step, outcome_step)``, or minus those in ``[outcome_step, fire_step)`` (late)."""
    lo, hi = sorted((fire_step, outcome_step))
    count = bisect.bisect_left(steps, hi) - bisect.bisect_left(steps, lo)
    return count if fire_step <= outcome_step else -count
