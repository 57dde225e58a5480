"""The earlier suite's scoring (``docs/instability-earlier.md``): runs read back, detectors chosen and scored.

Every run is read back from its collector with its outcome from the loss alone (:func:`read_back`);
each detector family's parameters are chosen on the tune split (:func:`choose`) and scored through the
backtest with spikes-only judging (:func:`detector_table`); beside them, each variant's learning-rate
sensitivity (:func:`lr_sensitivity`) and what RAA does on the contraction band (:func:`contraction`).
``experiments.instability`` runs it; the forecast's own study is :mod:`experiments.early_warning.forecast_study`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from experiments.common import log
from experiments.early_warning.detectors import FAMILIES, FIXED
from experiments.suite import SuiteRun
from qkwatch.client import backtest
from qkwatch.client.backtest_scores import RuleScore, summarize
from qkwatch.client.outcomes import Outcome, OutcomeRule, label
from qkwatch.client.rest import Client
from qkwatch.client.run_history import RunHistory, read
from qkwatch.rules.ruleset import RuleSet

# --- reading back -------------------------------------------------------------------------------------


@dataclass
class RunData:
    """One run as the collector holds it, with what the scoreboard needs of it."""

    run: SuiteRun
    history: RunHistory
    outcome: Outcome
    init_loss: float
    final_loss: float
    """Mean of the last ten logged training losses (NaN when they are not finite)."""
    val_loss: float | None
    """The last validation loss, None when none was logged (a run that stopped early)."""
    peaks: dict[str, float]
    """Per metric, the largest (``stable_rank``, ``attn_entropy``: also smallest) value over layers and reports."""

    def row(self) -> dict[str, Any]:
        r = self.run
        return {
            "name": r.name,
            "split": r.split,
            "pressure": r.pressure,
            "variant": r.variant,
            "lr": r.lr,
            "seed": r.seed,
            "induced": r.induced,
            "outcome": self.outcome.label,
            "outcome_step": self.outcome.step,
            "why": self.outcome.why,
            "init_loss": self.init_loss,
            "final_loss": self.final_loss,
            "val_loss": self.val_loss,
            "reports": len({x.step for x in self.history.reports}),
            "loss_steps": len(self.history.losses),
            "peaks": self.peaks,
            "loss_curve": _curve(self.history.loss_steps, self.history.losses),
            "reports_before_outcome": self.reports_before_outcome(),
        }

    def reports_before_outcome(self) -> int | None:
        """Reports at steps before the outcome's (None for a healthy run)."""
        if self.outcome.step is None:
            return None
        return sum(1 for step in {x.step for x in self.history.reports} if step < self.outcome.step)


def _curve(steps: Sequence[int], values: Sequence[float], points: int = 100) -> list[list[float]]:
    """At most ``points`` (step, value) pairs, evenly spaced, for the figures (NaN as None in JSON)."""
    stride = max(1, math.ceil(len(steps) / points))
    return [[s, v] for s, v in list(zip(steps, values, strict=True))[::stride]]


def read_back(client: Client, campaign: str, runs: Sequence[SuiteRun], outcome: OutcomeRule) -> list[RunData]:
    out = []
    for r in runs:
        history = read(client, f"{campaign}/{r.name}")
        if not history.losses:
            raise RuntimeError(f"{r.name}: no loss was logged; the suite needs every run's loss")
        val = client.series(f"{campaign}/{r.name}", "val_loss").values
        finite_val = [v for v in val if v is not None and math.isfinite(v)]
        tail = history.losses[-10:]
        out.append(
            RunData(
                r,
                history,
                label(history.loss_steps, history.losses, outcome),
                history.losses[0],
                statistics.fmean(tail) if all(math.isfinite(x) for x in tail) else math.nan,
                finite_val[-1] if finite_val else None,
                _peaks(history),
            )
        )
    return out


def _peaks(history: RunHistory) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for report in history.reports:
        for metric, layers in report.layers.items():
            values.setdefault(metric, []).extend(v for v in layers if v is not None and math.isfinite(v))
    out = {f"{m}_max": max(v) for m, v in values.items() if v}
    out |= {f"{m}_min": min(v) for m, v in values.items() if v and m in ("stable_rank", "attn_entropy")}
    return out


# --- detectors: chosen on tune, scored on test -----------------------------------------------------------


def ruleset(rules: Sequence[dict[str, Any]], collapse: float) -> RuleSet:
    return RuleSet.from_mapping({"rules": list(rules)}, collapse)


def score(data: Sequence[RunData], rules: RuleSet, outcome: OutcomeRule) -> list[RuleScore]:
    return summarize([backtest.backtest(d.history, rules, judging=_spikes_only(outcome)) for d in data])


def _spikes_only(outcome: OutcomeRule) -> backtest.Judging:
    """The earlier suite's judging: spikes and divergence from the loss, no reference, no loss-only row."""
    return backtest.Judging(outcome, loss_alert=None)


def choose(tune: Sequence[RunData], collapse: float, outcome: OutcomeRule) -> dict[str, dict[str, Any]]:
    """Per family, the candidate flagging most bad tune runs before their outcome with no healthy
    tune run fired on; ties go to the longer median lead in reports, then to the earlier candidate.
    A family whose every candidate fires on a healthy tune run, or that flags nothing, is not chosen.
    """
    chosen = {}
    for family, candidates in FAMILIES.items():
        best: tuple[tuple[float, float], dict[str, Any], RuleScore] | None = None
        for params in candidates:
            rule = {"name": family, **params}
            (s, _) = score(tune, ruleset([rule], collapse), outcome)
            key = (float(s.flagged), s.median_lead_reports or 0.0)
            if s.false_alarms == 0 and s.flagged > 0 and (best is None or key > best[0]):
                best = (key, rule, s)
        if best is not None:
            chosen[family] = {"rule": best[1], "tune": best[2].to_json()}
        log(
            f"  {family}: {'chose ' + str(best[1]) if best else 'nothing chosen (no candidate flags a bad tune run without a false alarm)'}"
        )
    return chosen


def detector_table(
    data: Sequence[RunData], chosen: dict[str, dict[str, Any]], collapse: float, outcome: OutcomeRule
) -> dict[str, Any]:
    """The default rules (the user's, plus every chosen family) over ``data``: per rule and any rule."""
    rules = ruleset([*FIXED, *(c["rule"] for c in chosen.values())], collapse)
    results = [backtest.backtest(d.history, rules, judging=_spikes_only(outcome)) for d in data]
    return {
        "scores": [s.to_json() for s in summarize(results)],
        "runs": [r.to_json() for r in results],
    }


# --- learning-rate sensitivity, the contraction band --------------------------------------------------


def lr_sensitivity(data: Sequence[RunData]) -> dict[str, Any]:
    """Wortsman et al.'s LR sensitivity per variant: the mean over the swept rates of
    ``min(loss, loss at init) - best loss``, from each run's last validation loss (the loss at init
    where a run has none or it is not finite), per seed, then the mean over seeds."""
    sweep = [d for d in data if d.run.pressure == "learning rate" and d.run.lr is not None]
    out: dict[str, Any] = {}
    for variant in sorted({d.run.variant for d in sweep}):
        per_seed = []
        curve: dict[float, list[float]] = {}
        for seed in sorted({d.run.seed for d in sweep}):
            runs = [d for d in sweep if d.run.variant == variant and d.run.seed == seed]
            losses = [min(_loss(d), d.init_loss) for d in runs]
            for d, x in zip(runs, losses, strict=True):
                curve.setdefault(float(d.run.lr or 0), []).append(x)
            per_seed.append(statistics.fmean(x - min(losses) for x in losses))
        out[variant] = {
            "sensitivity": statistics.fmean(per_seed),
            "per_seed": per_seed,
            "curve": {lr: statistics.fmean(v) for lr, v in sorted(curve.items())},
        }
    return out


def _loss(d: RunData) -> float:
    if d.val_loss is not None and math.isfinite(d.val_loss):
        return d.val_loss
    return d.final_loss if math.isfinite(d.final_loss) else d.init_loss


BAND = (3, 4, 5)
"""collapse_cpu's intervention layers."""


def contraction(data: Sequence[RunData]) -> list[dict[str, Any]]:
    """The key-contraction runs (induced): per metric, the band's and the other layers' mean at the last
    report that measured it (the report at close may hold only the applied lambdas), and the band's
    lowest stable rank over the run."""
    out = []
    for d in data:
        if d.run.pressure != "key contraction":
            continue
        reports = sorted(d.history.reports, key=lambda r: r.step)
        row: dict[str, Any] = {
            "run": d.run.name,
            "variant": d.run.variant,
            "split": d.run.split,
            "step": reports[-1].step,
            "val_loss": d.val_loss,
            "outcome": d.outcome.label,
        }
        for metric in ("qkai", "stable_rank", "attn_entropy", "par", "lambda"):
            last = next((r for r in reversed(reports) if r.layers.get(metric)), None)
            values = (last.layers.get(metric) or []) if last else []
            band = [v for i, v in enumerate(values) if i in BAND and v is not None]
            rest = [v for i, v in enumerate(values) if i not in BAND and v is not None]
            row[metric] = {
                "band": statistics.fmean(band) if band else None,
                "rest": statistics.fmean(rest) if rest else None,
                "step": last.step if last else None,
            }
        low = [
            v for r in reports for i, v in enumerate(r.layers.get("stable_rank") or []) if i in BAND and v is not None
        ]
        row["band_stable_rank_min"] = min(low) if low else None
        par = [v for r in reports for i, v in enumerate(r.layers.get("par") or []) if i in BAND and v is not None]
        row["band_par_max"] = max(par) if par else None
        out.append(row)
    return out
