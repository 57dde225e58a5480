"""Stage 3 of ``experiments.yardstick``: every chosen rule, the shipped detectors and the baselines, scored.

Per part (the tune recipe's seeds 0-2 and seed 3, each held-out recipe) and side of the best rate:
bad runs flagged before their outcome, leads over the tuned loss-only baseline, alarms per healthy
run, each with its interval (:func:`score`), and whether the hot side meets the bar (:func:`verdict`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.early_warning.detectors import FIXED, shipped_detectors
from experiments.early_warning.yardstick_judging import (
    BAD,
    BAR,
    HELDOUT_RECIPES,
    TUNE_RECIPE,
    TUNE_SEEDS,
    Judged,
    counted,
    detector_firings,
    loss_firings,
    replayed,
)
from qkwatch.client.outcomes import loss_visible_step
from qkwatch.rules.loss_rules import LossRule

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
    fired = replayed([*FIXED, *detectors, *shipped], judged, collapse)
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
    name = j.run.name
    return {
        **dataclasses.asdict(j.run),
        "outcome": j.label,
        "outcome_step": j.outcome_step,
        "side": j.side,
        "final": j.final if math.isfinite(j.final) else None,
        "reference": j.reference,
        "twin": j.twin,
        "first_firings": {rule: steps[name] for rule, steps in fired.items() if name in steps},
    }


def shipped_rules() -> list[dict[str, Any]]:
    """detectors.yml's rules as users get them, less the user's collapse rules (scored as they are)."""
    return [{k: v for k, v in r.items() if k != "severity"} for r in shipped_detectors()]
