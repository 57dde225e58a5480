"""Issue 40's runs judged, and the search on the tune recipe: stages 1 and 2 of ``experiments.yardstick``.

Each run gets its outcome against its reference in its own recipe, its side of the best rate and, for
a raa run that coincides with its vanilla twin, that twin (:func:`judge_runs`); each held-out recipe's
outcome is fixed from its losses alone (:func:`fix_outcome`); every rule's first firings are found
(:func:`loss_firings`, :func:`detector_firings`, :func:`replayed`) and every family searched on the
tune recipe by the one criterion (:func:`tune`). The rules of judging are ``experiments/heldout_sweep.yml``'s header.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.early_warning import rule_search
from experiments.early_warning.instability_data import RunRecord
from qkwatch.client.backtest import replay
from qkwatch.client.outcomes import Degradation, choose_delta, final_heldout, judge
from qkwatch.rules.loss_rules import LossRule, LossSeries
from qkwatch.rules.ruleset import RuleSet

TUNE_RECIPE = "instability_small"


TUNE_SEEDS = (0, 1, 2)
"""The tune recipe's seeds the search sees; seed 3 (issue 31's held-out seed) is the in-recipe check."""


HELDOUT_RECIPES = ("heldout_long", "heldout_code")


COINCIDE_NATS = 0.05
"""A raa run whose logged losses never differ from its vanilla twin's by this much is counted once."""


BAD = ("diverged", "degraded", "spiked")


BAR = {"flagged": 0.80, "median_lead_steps": 50, "false_alarm_rate": 0.10}
"""Per held-out recipe, hot side (issue 40, fixed in heldout_sweep.yml before the runs were trained)."""


@dataclass(frozen=True)
class Run:
    name: str
    recipe: str
    variant: str
    lr: float
    seed: int


@dataclass
class Judged:
    """One run with its outcome, its side of the best rate, and whether it counts."""

    run: Run
    record: RunRecord
    final: float
    reference: float | None
    label: str
    outcome_step: int
    """Where the loss showed it (diverged, spiked), the last step (degraded, healthy)."""
    side: str
    """hot (rate above its variant's best in its recipe), cold (below) or best."""
    total_steps: int
    twin: str | None = None
    """The vanilla run a raa run coincides with (then it is not counted)."""

    @property
    def bad(self) -> bool:
        return self.label in BAD


# --- stage 2: the held-out recipes' outcome, from their losses alone -------------------------------------------


def best_rates(runs: Sequence[Run], final: Mapping[str, float]) -> dict[str, float]:
    """Per variant, the rate with the lowest mean final held-out loss over its seeds (finite on every seed)."""
    out = {}
    for variant in sorted({r.variant for r in runs}):
        by_lr: dict[float, list[float]] = {}
        for r in runs:
            if r.variant == variant:
                by_lr.setdefault(r.lr, []).append(final[r.name])
        finite = {lr: v for lr, v in by_lr.items() if all(math.isfinite(x) for x in v)}
        out[variant] = min(finite, key=lambda lr: (statistics.fmean(finite[lr]), lr))
    return out


def fix_outcome(runs: Sequence[Run], records: Mapping[str, RunRecord], k: int = 3) -> dict[str, Any]:
    """Per held-out recipe: best rates, the final losses there, their pooled spread and delta."""
    out = {}
    for recipe in sorted({r.recipe for r in runs}):
        part = [r for r in runs if r.recipe == recipe]
        final = {r.name: final_heldout(records[r.name].val_loss, k) for r in part}
        best = best_rates(part, final)
        groups = {v: [final[r.name] for r in part if r.variant == v and r.lr == lr] for v, lr in best.items()}
        delta, spread = choose_delta(list(groups.values()))
        out[recipe] = {"k": k, "best_rates": best, "finals_at_best": groups, "spread": spread, "delta": delta}
    return {
        "recipes": out,
        "rule": "per recipe, delta = 3 sqrt(2) x the pooled seed-to-seed standard deviation of the final held-out "
        "loss at each variant's best rate, rounded up to 0.01 nats (the tune recipe's rule, applied to its own runs)",
    }


# --- judging -----------------------------------------------------------------------------------------------------


def judge_runs(runs: Sequence[Run], records: Mapping[str, RunRecord], fixed: Mapping[str, Any]) -> list[Judged]:
    """Every run's outcome against its reference (same recipe, variant and seed at the best rate), its side,
    and its vanilla twin where a raa run coincides with one."""
    out = []
    by_key = {(r.recipe, r.variant, r.lr, r.seed): r for r in runs}
    for r in runs:
        f = fixed[r.recipe]
        rule = Degradation(delta=float(f["delta"]), k=int(f["k"]), spread=float(f["spread"]))
        best = float(f["best_rates"][r.variant])
        h = records[r.name].history
        final = final_heldout(records[r.name].val_loss, rule.k)
        ref_run = by_key.get((r.recipe, r.variant, best, r.seed))
        reference = None
        if ref_run is not None and ref_run.name != r.name:
            reference = final_heldout(records[ref_run.name].val_loss, rule.k)
        total = int(max(h.loss_steps)) + 1
        outcome = judge(h.loss_steps, h.losses, final, reference, rule)
        step = outcome.step if outcome.label in ("diverged", "spiked") and outcome.step is not None else total - 1
        side = "hot" if r.lr > best else "cold" if r.lr < best else "best"
        out.append(Judged(r, records[r.name], final, reference, outcome.label, step, side, total))
    _mark_twins(out, by_key)
    return out


def coincide(a: RunRecord, b: RunRecord) -> bool:
    """The two runs' logged training losses never differ by :data:`COINCIDE_NATS` or more."""
    x, y = np.asarray(a.history.losses, dtype=float), np.asarray(b.history.losses, dtype=float)
    if x.shape != y.shape or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return False
    return bool(np.max(np.abs(x - y)) < COINCIDE_NATS)


def _mark_twins(judged: list[Judged], by_key: Mapping[tuple[str, str, float, int], Run]) -> None:
    records = {j.run.name: j.record for j in judged}
    for j in judged:
        r = j.run
        twin = by_key.get((r.recipe, "vanilla", r.lr, r.seed))
        if r.variant == "raa" and twin is not None and coincide(j.record, records[twin.name]):
            j.twin = twin.name


# --- first firings ------------------------------------------------------------------------------------------


def loss_firings(rules: Sequence[LossRule], judged: Sequence[Judged]) -> list[dict[str, int]]:
    """Per rule, run -> the step it first fires at (runs it never fires on are absent)."""
    out: list[dict[str, int]] = [{} for _ in rules]
    for j in judged:
        h = j.record.history
        series = LossSeries(h.loss_steps, h.losses)
        for i, rule in enumerate(rules):
            step = series.first_firing(rule, j.total_steps)
            if step is not None:
                out[i][j.run.name] = step
    return out


def detector_firings(candidates: Sequence[Mapping[str, Any]], judged: Sequence[Judged]) -> list[dict[str, int]]:
    """Per candidate rule, run -> the step of its first firing, by the search's numpy replica."""
    out: list[dict[str, int]] = [{} for _ in candidates]
    metrics = sorted({c["metric"] for c in candidates})
    for j in judged:
        grids = {m: rule_search.grids(j.record.history.reports, m) for m in metrics}
        for i, c in enumerate(candidates):
            step = rule_search.first_firing(c, grids[c["metric"]])
            if step is not None:
                out[i][j.run.name] = step
    return out


def replayed(
    rules: Sequence[Mapping[str, Any]], judged: Sequence[Judged], collapse: float
) -> dict[str, dict[str, int]]:
    """Rule name -> run -> first firing step, through the collector's own evaluator."""
    rs = RuleSet.from_mapping({"rules": [dict(r) for r in rules]}, collapse)
    out: dict[str, dict[str, int]] = {r["name"]: {} for r in rules}
    for j in judged:
        for firing in replay(rs, j.record.history.reports):
            out[firing.rule].setdefault(j.run.name, firing.step)
    return out


# --- stage 1: the search on the tune recipe ------------------------------------------------------------------


def counted(judged: Sequence[Judged]) -> list[Judged]:
    """The runs that count: a raa run that coincides with its vanilla twin is counted as that twin."""
    return [j for j in judged if j.twin is None]


def tune_split(judged: Sequence[Judged]) -> tuple[dict[str, int], list[str]]:
    """The search's targets: hot-side bad runs -> their outcome step; and the healthy runs."""
    part = counted(judged)
    bad = {j.run.name: j.outcome_step for j in part if j.bad and j.side == "hot"}
    return bad, [j.run.name for j in part if not j.bad]


def tune(judged: Sequence[Judged]) -> dict[str, Any]:
    """Every family searched on ``judged`` (the tune recipe's seeds 0-2) by the one criterion."""
    bad, healthy = tune_split(judged)
    chosen: dict[str, Any] = {}
    for family, rules in rule_search.LOSS_FAMILIES.items():
        pick = rule_search.choose(family, loss_firings(rules, judged), bad, healthy)
        if pick is not None:
            chosen[family] = {"loss_rule": rules[pick.index].to_json(), "tune": pick.__dict__, "of": len(rules)}
    for family, cands in rule_search.DETECTOR_FAMILIES.items():
        pick = rule_search.choose(family, detector_firings(cands, judged), bad, healthy)
        if pick is not None:
            chosen[family] = {"rule": {"name": family, **cands[pick.index]}, "tune": pick.__dict__, "of": len(cands)}
    losses = [f for f in rule_search.LOSS_FAMILIES if f in chosen]
    baseline = min(
        losses, key=lambda f: (*rule_search.criterion_key(rule_search.Pick(**chosen[f]["tune"])), losses.index(f))
    )
    return {
        "runs": [j.run.name for j in judged],
        "hot_bad": len(bad),
        "healthy": len(healthy),
        "twins": sorted(j.run.name for j in judged if j.twin),
        "chosen": chosen,
        "baseline": baseline,
        "unchosen": sorted((set(rule_search.LOSS_FAMILIES) | set(rule_search.DETECTOR_FAMILIES)) - set(chosen)),
    }
