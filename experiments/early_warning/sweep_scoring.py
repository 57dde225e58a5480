"""The sweep's two stages as pure functions (issue 31): the outcome fixed from the losses, then the scoreboard.

:func:`fix_outcome` (stage 1) chooses each variant's best rate and ``delta`` from the final held-out
losses; :func:`scoreboard` (stage 2) judges every run, chooses each detector family on the tune seed and
scores every rule and baseline on each split. ``experiments.sweep_analysis`` reads the committed files
and runs them; what a bad run, a false alarm and a lead are is in its docstring.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from experiments.early_warning.instability_data import RunRecord
from qkwatch.client.backtest import replay
from qkwatch.client.outcomes import Degradation, Outcome, choose_delta, final_heldout, judge, loss_visible_step
from qkwatch.rules.ruleset import RuleSet

BAD = ("diverged", "degraded", "spiked")


BAR = {"flagged": 0.80, "median_lead_steps": 50, "false_alarm_rate": 0.10}
"""The bar a rule must meet on held-out runs to ship as a default, fixed before the suite ran: at least
80 % of the bad runs flagged, a median lead of at least 50 steps over the loss-only alert, and at most
one false alarm in ten runs."""


@dataclass(frozen=True)
class Sweep:
    """What the analysis needs of one run of the suite file (``experiments.instability.SuiteRun``)."""

    name: str
    variant: str
    lr: float
    seed: int
    split: str


@dataclass
class Judged:
    run: Sweep
    record: RunRecord
    final: float
    """Final held-out loss (mean of the last ``k`` evaluations; inf when not finite)."""
    reference: float | None
    outcome: Outcome
    visible: int | None
    """The loss-visible step: the first step the loss-only alert fires (None: never)."""
    total_steps: int

    @property
    def bad(self) -> bool:
        return self.outcome.label in BAD

    @property
    def known_at(self) -> int:
        """When a loss-only user knows: the loss-visible step, else the run's last step."""
        return self.visible if self.visible is not None else self.total_steps - 1


# --- stage 1: the outcome, fixed before any scoring ------------------------------------------------------


def finals(records: Mapping[str, RunRecord], k: int) -> dict[str, float]:
    return {name: final_heldout(r.val_loss, k) for name, r in records.items()}


def best_rates(runs: Sequence[Sweep], final: Mapping[str, float]) -> dict[str, float]:
    """Per variant, the rate whose mean final held-out loss over the tune and test seeds is lowest
    (a rate with a non-finite final on any of those seeds is not a candidate)."""
    out = {}
    for variant in sorted({r.variant for r in runs}):
        by_lr: dict[float, list[float]] = {}
        for r in runs:
            if r.variant == variant and r.split in ("tune", "test"):
                by_lr.setdefault(r.lr, []).append(final[r.name])
        finite = {lr: v for lr, v in by_lr.items() if all(math.isfinite(x) for x in v)}
        out[variant] = min(finite, key=lambda lr: (statistics.fmean(finite[lr]), lr))
    return out


def fix_outcome(runs: Sequence[Sweep], records: Mapping[str, RunRecord], k: int = 3) -> dict[str, Any]:
    """Stage 1: the best rates, the spread of the final held-out loss there, and delta from it."""
    final = finals(records, k)
    best = best_rates(runs, final)
    groups = {
        v: [final[r.name] for r in runs if r.variant == v and r.lr == lr and r.split in ("tune", "test")]
        for v, lr in best.items()
    }
    delta, spread = choose_delta(list(groups.values()))
    return {
        "k": k,
        "best_rates": best,
        "finals_at_best": groups,
        "spread": spread,
        "delta": delta,
        "rule": "delta = 3 sqrt(2) x the pooled seed-to-seed standard deviation of the final held-out loss "
        "at each variant's best rate (tune and test seeds), rounded up to 0.01 nats",
    }


# --- stage 2: judging and scoring --------------------------------------------------------------------------


def judge_runs(runs: Sequence[Sweep], records: Mapping[str, RunRecord], fixed: Mapping[str, Any]) -> list[Judged]:
    """Every run's outcome against its reference (same variant and seed at the variant's best rate)."""
    rule = Degradation(delta=float(fixed["delta"]), k=int(fixed["k"]), spread=float(fixed["spread"]))
    final = finals(records, rule.k)
    best = {v: float(lr) for v, lr in fixed["best_rates"].items()}
    by_key = {(r.variant, r.lr, r.seed): r for r in runs}
    out = []
    for r in runs:
        rec = records[r.name]
        h = rec.history
        ref_run = by_key.get((r.variant, best[r.variant], r.seed))
        reference = None if ref_run is None or ref_run.name == r.name else final[ref_run.name]
        total = (max(h.loss_steps) + 1) if h.loss_steps else 0
        visible = loss_visible_step(h.loss_steps, h.losses, total)
        outcome = judge(h.loss_steps, h.losses, final[r.name], reference, rule, visible=visible)
        out.append(Judged(r, rec, final[r.name], reference, outcome, visible, total))
    return out


def firing_steps(rules: RuleSet, judged: Sequence[Judged]) -> dict[str, dict[str, int]]:
    """Rule name -> run name -> the step of its first alert (a run it never fired on is absent)."""
    out: dict[str, dict[str, int]] = {}
    for j in judged:
        for firing in replay(rules, j.record.history.reports):
            out.setdefault(firing.rule, {}).setdefault(j.run.name, firing.step)
    return out


def score(judged: Sequence[Judged], fired: Mapping[str, int]) -> dict[str, Any]:
    """One detector (``fired``: run name -> first alert step) on ``judged``: flagged, leads, false alarms."""
    bad = [j for j in judged if j.bad]
    healthy = [j for j in judged if not j.bad]
    leads = [j.known_at - fired[j.run.name] for j in bad if j.run.name in fired]
    false = [j.run.name for j in healthy if j.run.name in fired]
    return {
        "runs": len(judged),
        "bad": len(bad),
        "flagged": len(leads),
        "flagged_fraction": len(leads) / len(bad) if bad else None,
        "median_lead_steps": statistics.median(leads) if leads else None,
        "leads": sorted(leads),
        "healthy": len(healthy),
        "false_alarms": len(false),
        "false_alarm_rate": len(false) / len(judged) if judged else None,
        "false_alarm_runs": false,
    }


def meets_bar(s: Mapping[str, Any]) -> bool:
    return (
        s["flagged_fraction"] is not None
        and s["flagged_fraction"] >= BAR["flagged"]
        and s["median_lead_steps"] is not None
        and s["median_lead_steps"] >= BAR["median_lead_steps"]
        and s["false_alarm_rate"] is not None
        and s["false_alarm_rate"] <= BAR["false_alarm_rate"]
    )


def beats(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """``a`` does better than ``b`` on the same runs: it flags more bad runs with no more false alarms,
    or as many with fewer. (Lead time is the bar's business.) A rule ships as a default only when it
    meets the bar and beats every baseline; both fixed before the suite ran."""
    more = a["flagged"] >= b["flagged"] and a["false_alarms"] <= b["false_alarms"]
    return more and (a["flagged"] > b["flagged"] or a["false_alarms"] < b["false_alarms"])


def loss_alert_firings(judged: Sequence[Judged]) -> dict[str, int]:
    """The loss-only baseline: it fires where the loss becomes visible."""
    return {j.run.name: j.visible for j in judged if j.visible is not None}


def choose_lr_threshold(tune: Sequence[Judged]) -> float | None:
    """The "alert from the start at lr >= X" baseline's X: the smallest swept rate above every healthy
    tune run's (no false alarm on tune); None when the highest rate has a healthy tune run."""
    healthy = [j.run.lr for j in tune if not j.bad]
    rates = sorted({j.run.lr for j in tune})
    above = [lr for lr in rates if not healthy or lr > max(healthy)]
    return above[0] if above else None


def lr_firings(judged: Sequence[Judged], threshold: float | None) -> dict[str, int]:
    if threshold is None:
        return {}
    return {j.run.name: 0 for j in judged if j.run.lr >= threshold}


def choose(
    tune: Sequence[Judged],
    families: Mapping[str, Sequence[dict[str, Any]]],
    make: Callable[[list[dict[str, Any]]], RuleSet],
) -> dict[str, dict[str, Any]]:
    """Per family, the candidate that flags most bad tune runs with no alert on a healthy tune run; ties
    go to the longer median lead, then to the earlier candidate. None flags without a false alarm:
    nothing is chosen for that family."""
    chosen = {}
    for family, candidates in families.items():
        best: tuple[tuple[float, float], dict[str, Any], dict[str, Any]] | None = None
        for params in candidates:
            rule = {"name": family, **params}
            s = score(tune, firing_steps(make([rule]), tune).get(family, {}))
            key = (float(s["flagged"]), float(s["median_lead_steps"] or -math.inf))
            if s["false_alarms"] == 0 and s["flagged"] > 0 and (best is None or key > best[0]):
                best = (key, rule, s)
        if best is not None:
            chosen[family] = {"rule": best[1], "tune": best[2]}
    return chosen


def lr_sensitivity(judged: Sequence[Judged]) -> dict[str, Any]:
    """Wortsman et al.'s LR sensitivity per variant and seed: the mean over the swept rates of
    ``min(final, loss at init) - best final``; the mean and standard deviation over seeds."""
    out: dict[str, Any] = {}
    for variant in sorted({j.run.variant for j in judged}):
        per_seed = {}
        for seed in sorted({j.run.seed for j in judged}):
            runs = [j for j in judged if j.run.variant == variant and j.run.seed == seed]
            losses = [min(j.final, j.record.history.losses[0]) for j in runs]
            per_seed[seed] = statistics.fmean(x - min(losses) for x in losses)
        values = list(per_seed.values())
        out[variant] = {
            "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None,
            "per_seed": per_seed,
        }
    return out


def scoreboard(
    runs: Sequence[Sweep],
    records: Mapping[str, RunRecord],
    fixed: Mapping[str, Any],
    families: Mapping[str, Sequence[dict[str, Any]]],
    fixed_rules: Sequence[dict[str, Any]],
    make: Callable[[list[dict[str, Any]]], RuleSet],
    shipped: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Stage 2: every run judged; detectors chosen on tune; every rule and baseline scored on each split.

    ``shipped``: rules scored as they are, untuned, beside the chosen ones (the candidate detectors'
    file as users get it), each named ``detectors.yml:<name>``."""
    judged = judge_runs(runs, records, fixed)
    split = {name: [j for j in judged if j.run.split == name] for name in ("tune", "test", "holdout")}
    chosen = choose(split["tune"], families, make)
    threshold = choose_lr_threshold(split["tune"])
    rules = [*fixed_rules, *(c["rule"] for c in chosen.values())]
    fired = firing_steps(make(rules), judged)
    for rule in shipped:
        as_shipped = {**rule, "name": f"detectors.yml:{rule['name']}"}
        fired[as_shipped["name"]] = firing_steps(make([as_shipped]), judged).get(as_shipped["name"], {})
        rules.append(as_shipped)
    tuned = {r["name"] for r in [*fixed_rules, *(c["rule"] for c in chosen.values())]}
    first_any = {
        j.run.name: min(steps[j.run.name] for rule, steps in fired.items() if rule in tuned and j.run.name in steps)
        for j in judged
        if any(j.run.name in steps for rule, steps in fired.items() if rule in tuned)
    }
    detectors: dict[str, dict[str, int]] = {r["name"]: fired.get(r["name"], {}) for r in rules}
    detectors["any chosen or collapse rule"] = first_any
    baselines = {"loss-only alert": loss_alert_firings(judged), f"lr >= {threshold:g}": lr_firings(judged, threshold)}
    tables = {}
    for name, part in split.items():
        tables[name] = {
            rule: {
                **score(part, {k: v for k, v in steps.items() if k in {j.run.name for j in part}}),
                "baseline": rule in baselines,
            }
            for rule, steps in {**detectors, **baselines}.items()
        }
        for row in tables[name].values():
            row["meets_bar"] = meets_bar(row)
        base_rows = [row for row in tables[name].values() if row["baseline"]]
        for row in tables[name].values():
            row["beats_baselines"] = not row["baseline"] and all(beats(row, b) for b in base_rows)
            row["default"] = row["meets_bar"] and row["beats_baselines"]
    return {
        "outcome": dict(fixed),
        "bar": BAR,
        "chosen": chosen,
        "lr_threshold": threshold,
        "tables": tables,
        "runs": [_row(j, detectors, baselines) for j in judged],
        "lr_sensitivity": lr_sensitivity(judged),
    }


def _row(
    j: Judged, detectors: Mapping[str, Mapping[str, int]], baselines: Mapping[str, Mapping[str, int]]
) -> dict[str, Any]:
    return {
        "name": j.run.name,
        "variant": j.run.variant,
        "lr": j.run.lr,
        "seed": j.run.seed,
        "split": j.run.split,
        "outcome": j.outcome.label,
        "outcome_step": j.outcome.step,
        "why": j.outcome.why,
        "final": j.final if math.isfinite(j.final) else None,
        "reference": j.reference,
        "loss_visible_step": j.visible,
        "first_alerts": {
            rule: steps[j.run.name] for rule, steps in {**detectors, **baselines}.items() if j.run.name in steps
        },
        "peaks": peaks(j.record),
    }


PEAKS = {"logit_max": max, "qkai": max, "attn_entropy": min, "stable_rank": min}
"""Per run, each metric's extreme over its layers and reports (the direction trouble goes)."""


def peaks(record: RunRecord) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for metric, pick in PEAKS.items():
        values = [
            float(v)
            for report in record.history.reports
            for v in report.layers.get(metric) or []
            if v is not None and math.isfinite(v)
        ]
        out[metric] = pick(values) if values else None
    return out
