"""Backtest scores over many runs: per rule, recall, false alarms and median leads (:func:`summarize`).

Each run is a :class:`~qkwatch.client.backtest.RunBacktest`; a rule's row is scored from its
:class:`~qkwatch.client.backtest.RuleResult` on each run, and :data:`~qkwatch.client.backtest.ANY_RULE`
from each run's earliest firing of any rule.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qkwatch.client.backtest import ANY_RULE, BAD, LOSS_ROW, RuleResult, RunBacktest


@dataclass(frozen=True)
class RuleScore:
    """One rule (or :data:`ANY_RULE`) over many runs."""

    rule: str
    bad_runs: int
    """Runs that diverged or spiked."""
    flagged: int
    """Bad runs on which it fired before the outcome's step (lead > 0)."""
    late: int
    """Bad runs on which it first fired at or after the outcome's step."""
    recall: float | None
    """``flagged / bad_runs``; None without bad runs."""
    healthy_runs: int
    false_alarms: int
    """Healthy runs on which it fired."""
    false_alarm_rate: float | None
    """``false_alarms / healthy_runs``: the share of the runs that went well it alarmed on."""
    unknown_runs: int
    """Runs without a loss, not scored."""
    median_lead_steps: float | None
    """Over the flagged runs."""
    median_lead_reports: float | None
    """Over the flagged runs."""
    median_lead_vs_loss: float | None = None
    """Over the flagged runs: how much earlier than the loss-only alert (:attr:`RuleResult.lead_vs_loss`)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(results: Sequence[RunBacktest]) -> list[RuleScore]:
    """Per rule, and for :data:`ANY_RULE` (each run's earliest firing of any rule): recall, false alarms
    and median leads over ``results``."""
    names = list(dict.fromkeys(r.rule for run in results for r in run.rules if r.rule != LOSS_ROW))
    loss = [LOSS_ROW] if any(r.rule == LOSS_ROW for run in results for r in run.rules) else []
    return [_score(name, [(run, _pick(run, name)) for run in results]) for name in [*names, ANY_RULE, *loss]]


def _pick(run: RunBacktest, name: str) -> RuleResult | None:
    """The run's result for ``name``; for :data:`ANY_RULE` the earliest firing rule's (None: none fired)."""
    if name != ANY_RULE:
        return next((r for r in run.rules if r.rule == name), None)
    fired = [r for r in run.rules if r.first_fire_step is not None and r.rule != LOSS_ROW]
    return min(fired, key=lambda r: (r.attempt or 0, r.first_fire_step or 0), default=None)


def _score(name: str, pairs: list[tuple[RunBacktest, RuleResult | None]]) -> RuleScore:
    bad = [r for run, r in pairs if run.outcome in BAD]
    early = [r for r in bad if r is not None and r.lead_steps is not None and r.lead_steps > 0]
    late = [r for r in bad if r is not None and r.lead_steps is not None and r.lead_steps <= 0]
    healthy = [r for run, r in pairs if run.outcome == "healthy"]
    alarms = sum(1 for r in healthy if r is not None and r.firings)
    return RuleScore(
        rule=name,
        bad_runs=len(bad),
        flagged=len(early),
        late=len(late),
        recall=len(early) / len(bad) if bad else None,
        healthy_runs=len(healthy),
        false_alarms=alarms,
        false_alarm_rate=alarms / len(healthy) if healthy else None,
        unknown_runs=sum(1 for run, _ in pairs if run.outcome == "unknown"),
        median_lead_steps=_median([r.lead_steps for r in early]),
        median_lead_reports=_median([r.lead_reports for r in early]),
        median_lead_vs_loss=_median([r.lead_vs_loss for r in early]),
    )


def _median(values: Sequence[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(statistics.median(known)) if known else None
