"""Issue 40: does a qkwatch rule warn earlier than the loss, on recipes nobody tuned anything on?

Everything here reads committed files only: the per-step runs of the tune recipe
(``instability_sweep_runs.npz``, 144 runs of ``instability_small``) and of the held-out recipes
(``heldout_sweep_runs.npz``, ``heldout_long`` and ``heldout_code``), and the outcomes fixed for each
before anything was scored on it. In order (the commits show it):

1. ``--tune``: on the tune recipe's seeds 0-2, every detector family and every loss-only family is
   searched the same way (:func:`experiments.rule_search.choose`); the tuned loss-only baseline is the
   loss family the same criterion puts first. Written to ``yardstick_tuned.json`` and committed before
   the held-out runs are scored.
2. ``--fix-outcome``: each held-out recipe's best rates and delta from its losses alone
   (``heldout_sweep_outcome.json``), committed before scoring.
3. ``--score``: the chosen rules replayed through the collector's own evaluator on every run, checked
   against the search's replica, and scored per recipe and side (``yardstick.json``).

How a run is judged, which side it is on, what a false alarm and a lead are, when a raa run counts as
its vanilla twin and the bar: ``experiments/heldout_sweep.yml``'s header, fixed before the held-out runs
were trained; the code below is that text.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments import rule_search
from experiments.common import RESULTS, ROOT
from experiments.instability_data import RunRecord
from qkwatch.monitor.alerting.ruleset import RuleSet
from qkwatch.monitor.backtest import replay
from qkwatch.monitor.loss_rules import LossRule, LossSeries
from qkwatch.monitor.outcomes import Degradation, choose_delta, final_heldout, judge, loss_visible_step

TUNE_SUITE, HELDOUT_SUITE = ROOT / "instability_sweep.yml", ROOT / "heldout_sweep.yml"
TUNE_DATA, HELDOUT_DATA = RESULTS / "instability_sweep_runs.npz", RESULTS / "heldout_sweep_runs.npz"
TUNE_OUTCOME, HELDOUT_OUTCOME = RESULTS / "instability_sweep_outcome.json", RESULTS / "heldout_sweep_outcome.json"
TUNED, SCORES = RESULTS / "yardstick_tuned.json", RESULTS / "yardstick.json"
HELDOUT_CAMPAIGN = "heldout_sweep"

TUNE_RECIPE = "instability_small"
TUNE_SEEDS = (0, 1, 2)
"""The tune recipe's seeds the search sees; seed 3 (issue 31's held-out seed) is the in-recipe check."""
HELDOUT_RECIPES = ("heldout_long", "heldout_code")
COINCIDE_NATS = 0.05
"""A raa run whose logged losses never differ from its vanilla twin's by this much is counted once."""
BAD = ("diverged", "degraded", "spiked")
BAR = {"flagged": 0.80, "median_lead_steps": 50, "false_alarm_rate": 0.10}
"""Per held-out recipe, hot side (issue 40, fixed in heldout_sweep.yml before the runs were trained)."""
FIXED_RULES: list[dict[str, Any]] = [
    {"name": "qkai_high", "metric": "qkai", "op": ">", "for_reports": 3},
    {"name": "collapse_band", "band_of": "qkai_high", "min_layers": 3, "severity": "critical"},
]
"""The user's collapse rules, never tuned."""
DETECTORS = ROOT.parent / "qkwatch" / "dashboards" / "rules" / "detectors.yml"


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


# --- the runs ------------------------------------------------------------------------------------------------


def suite_runs(path: Path) -> list[Run]:
    from experiments.suite import load_runs

    return [Run(r.name, r.recipe, r.variant, float(r.lr or 0.0), r.seed) for r in load_runs(path)]


def load_records(path: Path, runs: Sequence[Run]) -> dict[str, RunRecord]:
    """The runs of ``runs`` in the npz; SystemExit naming what is missing."""
    from experiments import instability_data

    records = instability_data.load(path) if path.exists() else {}
    missing = [r.name for r in runs if r.name not in records]
    if missing:
        raise SystemExit(
            f"{path.name} lacks {len(missing)} of {len(runs)} runs (e.g. {missing[0]}): train them "
            f"(python -m experiments.instability --runs experiments/heldout_sweep.yml --campaign "
            f"{HELDOUT_CAMPAIGN} --train-only), then python -m experiments.yardstick --export"
        )
    return {r.name: records[r.name] for r in runs}


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


def outcomes() -> dict[str, dict[str, Any]]:
    """Each recipe's fixed outcome: the tune recipe's (issue 31) and the held-out ones'."""
    tune = json.loads(TUNE_OUTCOME.read_text())
    held = json.loads(HELDOUT_OUTCOME.read_text())["recipes"] if HELDOUT_OUTCOME.exists() else {}
    return {TUNE_RECIPE: tune, **held}


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


# --- stage 3: scoring -----------------------------------------------------------------------------------------

OLD_ALERT = "loss-only alert (issue 31)"
ANY = "any chosen attention rule"
ANY_LOSS = "any chosen loss rule"


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """The 95 % Wilson interval of the fraction k / n; None when n is 0."""
    if n == 0:
        return None
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, mid - half), min(1.0, mid + half)]


def median_interval(values: Sequence[float], rounds: int = 2000, seed: int = 0) -> list[float] | None:
    """A 95 % percentile bootstrap interval of the median (seeded: the page is reproducible)."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return [float(medians[int(0.025 * rounds)]), float(medians[int(0.975 * rounds) - 1])]


def score(
    part: Sequence[Judged],
    side: str,
    fired: Mapping[str, int],
    baseline: Mapping[str, int],
    old: Mapping[str, int],
    any_loss: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """One rule on one side of ``part``: bad runs flagged, leads over the tuned loss-only baseline (and over
    issue 31's loss-only alert, and over the earliest of the chosen loss rules), and alarms per healthy run."""
    runs = counted(part)
    bad = [j for j in runs if j.bad and j.side == side]
    healthy = [j for j in runs if not j.bad]
    flagged = [j for j in bad if j.run.name in fired and fired[j.run.name] <= j.outcome_step]

    def lead(j: Judged, yardstick: Mapping[str, int]) -> int:
        return min(yardstick.get(j.run.name, j.outcome_step), j.outcome_step) - fired[j.run.name]

    leads = [lead(j, baseline) for j in flagged]
    old_leads = [lead(j, old) for j in flagged]
    any_leads = [lead(j, any_loss) for j in flagged] if any_loss is not None else []
    alarms = sorted(j.run.name for j in healthy if j.run.name in fired)
    return {
        "bad": len(bad),
        "flagged": len(flagged),
        "flagged_fraction": len(flagged) / len(bad) if bad else None,
        "flagged_interval": wilson(len(flagged), len(bad)),
        "median_lead_steps": statistics.median(leads) if leads else None,
        "lead_interval": median_interval(leads),
        "leads": sorted(leads),
        "median_lead_old_alert": statistics.median(old_leads) if old_leads else None,
        "median_lead_any_loss": statistics.median(any_leads) if any_leads else None,
        "healthy": len(healthy),
        "false_alarms": len(alarms),
        "false_alarm_rate": len(alarms) / len(healthy) if healthy else None,
        "false_alarm_interval": wilson(len(alarms), len(healthy)),
        "false_alarm_runs": alarms,
        "false_alarm_steps": sorted(fired[n] for n in alarms),
    }


def verdict(s: Mapping[str, Any]) -> dict[str, Any]:
    """Whether a hot-side score meets the bar, and by how much each part is missed."""
    missed = []
    if s["flagged_fraction"] is None or s["flagged_fraction"] < BAR["flagged"]:
        missed.append(f"flagged {s['flagged']}/{s['bad']}, needs {math.ceil(BAR['flagged'] * s['bad'])}")
    if s["median_lead_steps"] is None or s["median_lead_steps"] < BAR["median_lead_steps"]:
        none = s["median_lead_steps"] is None
        lead = "no lead (nothing flagged)" if none else f"median lead {s['median_lead_steps']:g} steps"
        missed.append(f"{lead}, needs {BAR['median_lead_steps']}")
    if s["false_alarm_rate"] is None or s["false_alarm_rate"] > BAR["false_alarm_rate"]:
        allowed = math.floor(BAR["false_alarm_rate"] * s["healthy"])
        missed.append(f"{s['false_alarms']}/{s['healthy']} healthy runs alarmed, at most {allowed} allowed")
    return {"met": not missed, "missed": missed}


def rate_threshold(judged: Sequence[Judged]) -> float | None:
    """The "alert at rate >= X" baseline's X, by the one criterion: the smallest rate above every healthy
    tune run's rate (no alarm), so that it flags the most hot-side bad runs."""
    healthy = [j.run.lr for j in counted(judged) if not j.bad]
    above = sorted({j.run.lr for j in judged if not healthy or j.run.lr > max(healthy)})
    return above[0] if above else None


PARTS = {
    "tune": "tune recipe, seeds 0-2 (tuned on)",
    "tune_seed3": "tune recipe, seed 3 (in-recipe check)",
    "heldout_long": "heldout_long (held out)",
    "heldout_code": "heldout_code (held out)",
}


def parts(judged: Sequence[Judged]) -> dict[str, list[Judged]]:
    tune_recipe = [j for j in judged if j.run.recipe == TUNE_RECIPE]
    return {
        "tune": [j for j in tune_recipe if j.run.seed in TUNE_SEEDS],
        "tune_seed3": [j for j in tune_recipe if j.run.seed not in TUNE_SEEDS],
        **{r: [j for j in judged if j.run.recipe == r] for r in HELDOUT_RECIPES},
    }


def scoreboard(judged: Sequence[Judged], tuned: Mapping[str, Any], collapse: float) -> dict[str, Any]:
    """Every chosen rule, the shipped detectors, the user's collapse rules and the baselines, per part and side."""
    chosen = tuned["chosen"]
    detectors = [c["rule"] for c in chosen.values() if "rule" in c]
    shipped = [{**r, "name": f"detectors.yml:{r['name']}"} for r in shipped_rules()]
    fired = replayed([*FIXED_RULES, *detectors, *shipped], judged, collapse)
    for rule in detectors:  # the search's replica must be the collector's evaluator
        (mine,) = detector_firings([{k: v for k, v in rule.items() if k != "name"}], judged)
        if mine != fired[rule["name"]]:
            diff = sorted(set(mine.items()) ^ set(fired[rule["name"]].items()))[:3]
            raise RuntimeError(f"{rule['name']}: the replica and the collector's evaluator differ: {diff}")
    fired[ANY] = _union([fired[r["name"]] for r in detectors])
    losses = [family for family, c in chosen.items() if "loss_rule" in c]
    for family in losses:
        (fired[family],) = loss_firings([LossRule.parse(chosen[family]["loss_rule"]["text"])], judged)
    fired[ANY_LOSS] = _union([fired[f] for f in losses])
    old = {j.run.name: s for j in judged if (s := _old_alert(j)) is not None}
    fired[OLD_ALERT] = old
    threshold = rate_threshold([j for j in judged if j.run.recipe == TUNE_RECIPE and j.run.seed in TUNE_SEEDS])
    fired[f"rate >= {threshold:g}"] = {j.run.name: 0 for j in judged if threshold is not None and j.run.lr >= threshold}
    baseline = fired[tuned["baseline"]]
    board: dict[str, Any] = {}
    for name, part in parts(judged).items():
        rows = {
            rule: {side: score(part, side, steps, baseline, old, fired[ANY_LOSS]) for side in ("hot", "cold")}
            for rule, steps in fired.items()
        }
        for row in rows.values():
            row["bar"] = verdict(row["hot"])
        board[name] = {"label": PARTS[name], "summary": summary(part), "rows": rows}
    defaults = [
        rule
        for rule in fired
        if rule in {r["name"] for r in detectors} | {ANY}
        and all(board[r]["rows"][rule]["bar"]["met"] for r in HELDOUT_RECIPES)
    ]
    return {
        "bar": BAR,
        "baseline": tuned["baseline"],
        "rate_threshold": threshold,
        "parts": board,
        "defaults": defaults,
        "runs": [_run_row(j, fired) for j in judged],
    }


def _union(maps: Sequence[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for run, step in m.items():
            out[run] = min(step, out.get(run, step))
    return out


def _old_alert(j: Judged) -> int | None:
    h = j.record.history
    return loss_visible_step(h.loss_steps, h.losses, j.total_steps)


def summary(part: Sequence[Judged]) -> dict[str, Any]:
    runs = counted(part)
    qkai = [
        v
        for j in part
        for report in j.record.history.reports
        for v in report.layers.get("qkai") or []
        if v is not None and math.isfinite(v)
    ]
    return {
        "runs": len(part),
        "counted": len(runs),
        "twins": len(part) - len(runs),
        "labels": {label: sum(j.label == label for j in runs) for label in (*BAD, "healthy")},
        "hot_bad": sum(j.bad and j.side == "hot" for j in runs),
        "cold_bad": sum(j.bad and j.side == "cold" for j in runs),
        "healthy": sum(not j.bad for j in runs),
        "qkai_max": max(qkai) if qkai else None,
    }


def _run_row(j: Judged, fired: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    r = j.run
    return {
        "name": r.name,
        "recipe": r.recipe,
        "variant": r.variant,
        "lr": r.lr,
        "seed": r.seed,
        "outcome": j.label,
        "outcome_step": j.outcome_step,
        "side": j.side,
        "final": j.final if math.isfinite(j.final) else None,
        "reference": j.reference,
        "twin": j.twin,
        "first_firings": {rule: steps[r.name] for rule, steps in fired.items() if r.name in steps},
    }


def shipped_rules() -> list[dict[str, Any]]:
    """detectors.yml's rules as users get them, less the user's collapse rules (scored as they are)."""
    import yaml

    fixed = {r["name"] for r in FIXED_RULES}
    rules = yaml.safe_load(DETECTORS.read_text())["rules"]
    return [{k: v for k, v in r.items() if k != "severity"} for r in rules if r["name"] not in fixed]


# --- the command line ----------------------------------------------------------------------------------------


def all_runs() -> tuple[list[Run], dict[str, RunRecord]]:
    tune_runs, held_runs = suite_runs(TUNE_SUITE), suite_runs(HELDOUT_SUITE)
    records = {**load_records(TUNE_DATA, tune_runs), **load_records(HELDOUT_DATA, held_runs)}
    return [*tune_runs, *held_runs], records


def tune_runs_judged() -> list[Judged]:
    runs = suite_runs(TUNE_SUITE)
    judged = judge_runs(runs, load_records(TUNE_DATA, runs), outcomes())
    return [j for j in judged if j.run.seed in TUNE_SEEDS]


def results() -> dict[str, Any]:
    """The whole analysis from the committed files; SystemExit when a stage's file is missing or moved."""
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD

    if not HELDOUT_OUTCOME.exists():
        raise SystemExit(f"{HELDOUT_OUTCOME.name} is missing: python -m experiments.yardstick --fix-outcome, commit")
    committed = json.loads(TUNED.read_text())
    runs, records = all_runs()
    judged = judge_runs(runs, records, outcomes())
    tuned = tune([j for j in judged if j.run.recipe == TUNE_RECIPE and j.run.seed in TUNE_SEEDS])
    if json.loads(json.dumps(tuned)) != committed:
        raise SystemExit(f"the search no longer gives what {TUNED.name} holds: the tuning is not moved")
    board = scoreboard(judged, tuned, COLLAPSE_THRESHOLD)
    return {"tuned": tuned, "outcomes": outcomes(), "collapse_threshold": COLLAPSE_THRESHOLD, **board}


def ready() -> bool:
    """Whether every stage's file is committed: the held-out runs, their outcome and the tuning."""
    return HELDOUT_DATA.exists() and HELDOUT_OUTCOME.exists() and TUNED.exists()


def scores_path() -> Path:
    return SCORES


def export() -> Path:
    """The held-out runs the campaign's collector holds finished, added to their npz (kept runs stay)."""
    from experiments import instability_data

    return instability_data.export(suite_runs(HELDOUT_SUITE), HELDOUT_CAMPAIGN, HELDOUT_DATA)


def save_json(data: Mapping[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m experiments.yardstick", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", action="store_true", help="the held-out runs from their collector into the npz")
    p.add_argument("--tune", action="store_true", help="stage 1: search every family on the tune recipe")
    p.add_argument("--fix-outcome", action="store_true", help="stage 2: the held-out recipes' best rates and delta")
    p.add_argument("--score", action="store_true", help="stage 3: score everything (yardstick.json)")
    args = p.parse_args(argv)
    if args.export:
        print(f"wrote {export()}")
    if args.tune:
        if TUNED.exists():
            raise SystemExit(f"{TUNED} exists: the tuning is fixed and is not moved")
        print(json.dumps(save_json(tune(tune_runs_judged()), TUNED).name))
    if args.fix_outcome:
        if HELDOUT_OUTCOME.exists():
            raise SystemExit(f"{HELDOUT_OUTCOME} exists: the outcome is fixed and is not moved")
        runs = suite_runs(HELDOUT_SUITE)
        fixed = fix_outcome(runs, load_records(HELDOUT_DATA, runs))
        save_json(fixed, HELDOUT_OUTCOME)
        print(json.dumps(fixed, indent=1))
    if args.score:
        print(f"wrote {save_json(results(), scores_path())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
