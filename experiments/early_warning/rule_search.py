"""The candidates of issue 40's search, and the one criterion that picks among them (pure).

Every family, a qkwatch detector or a loss-only rule a user could write, is searched the same way on
the tune recipe (:func:`choose`, :func:`criterion_key`). Only candidates with no alarm on any healthy
tune run compete. Among those that flag at least :data:`RECALL` of the hot-side bad tune runs (the
bar's share), the one whose median first firing over the runs it flagged is earliest wins (ties: more
flagged, then the earlier candidate in the family's list); when none reaches it, the one that flags the
most (ties: the earlier median first firing). So the loss-only baseline is the earliest loss rule that
still catches most of the trouble, not a late one that catches one run more. Grids are fine for both sides (thresholds in steps of 0.01 or
0.005, loss levels in steps of 0.025 nats), so neither side loses for want of tuning.

Detector candidates are rules of the collector's own kinds (threshold and growth). The search finds
their first firings with the numpy replica below (:func:`first_firings`), thousands of candidates in
seconds; the chosen rules are then replayed through the collector's evaluator
(:func:`qkwatch.client.backtest.replay`) and the two must agree on every run
(``experiments.yardstick`` checks it before it scores anything).
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qkwatch.rules.loss_rules import LossRule
from qkwatch.rules.transitions import ReportValues


def _grid(start: float, stop: float, step: float) -> list[float]:
    n = round((stop - start) / step)
    return [round(start + i * step, 6) for i in range(n + 1)]


STEPS_AT = (50, 100, 150, 200, 300)
"""The steps a level or fall rule checks at."""

LOSS_FAMILIES: dict[str, list[LossRule]] = {
    "loss_level": [LossRule("level", {"at": a, "above": x}) for a in STEPS_AT for x in _grid(1.0, 5.5, 0.025)],
    "loss_fall": [LossRule("fall", {"at": a, "fraction": f}) for a in STEPS_AT for f in _grid(0.05, 0.85, 0.005)],
    "loss_rise": [
        LossRule("rise", {"rise": r, "for_steps": n})
        for r in (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
        for n in (1, 5, 20, 50)
    ],
    "loss_plateau": [
        LossRule("plateau", {"span": s, "drop": d, "start": b, "until": u})
        for s in (50, 100, 200)
        for d in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
        for b in (50, 100, 200)
        for u in (0.5, 0.75, 1.0)
    ],
    "loss_slope": [
        LossRule("slope", {"span": s, "per_100": x, "start": b})
        for s in (50, 100, 200)
        for x in (0.0, 0.02, 0.05, 0.1, 0.2, 0.5)
        for b in (50, 100, 200)
    ],
}
"""Loss-only rules a user could write in any tracker (:mod:`qkwatch.rules.loss_rules`)."""


def _threshold(metric: str, op: str, values: Sequence[float], fors: Sequence[int]) -> list[dict[str, Any]]:
    return [{"metric": metric, "op": op, "threshold": x, "for_reports": n} for x in values for n in fors]


def _growth(metric: str, factors: Sequence[float], skips: Sequence[int], fors: Sequence[int]) -> list[dict[str, Any]]:
    return [
        {"kind": "growth", "metric": metric, "factor": f, "baseline_reports": 5, "skip_reports": k, "for_reports": n}
        for f in factors
        for k in skips
        for n in fors
    ]


SKIPS = (0, 1, 5, 10, 20, 30)
"""Reports a growth rule passes over before its baseline (at a report every 10 steps: up to step 300)."""

DETECTOR_FAMILIES: dict[str, list[dict[str, Any]]] = {
    # scale-free: entropy is normalised to [0, 1]; growth and fall are relative to the layer's own value
    "attn_one_hot": _threshold("attn_entropy", "<", _grid(0.01, 0.6, 0.01), (1, 2, 3, 5)),
    "attn_uniform": _threshold("attn_entropy", ">", _grid(0.9, 0.995, 0.005), (1, 3, 5, 10, 20)),
    "attn_top1_high": _threshold("attn_top1", ">", _grid(0.3, 0.99, 0.01), (1, 3, 5)),
    "logit_growth": _growth("logit_max", (1.5, 2, 2.5, 3, 4, 5, 7, 10, 15, 20, 30, 50), SKIPS, (1, 2, 3)),
    "stable_rank_fall": _growth("stable_rank", _grid(0.1, 0.9, 0.05), SKIPS, (1, 2, 3)),
    # not scale-free: a level of the metric, as a user might set it on one model
    "stable_rank_low": _threshold("stable_rank", "<", _grid(1.01, 3.0, 0.01), (1, 3, 5)),
    "logit_max_high": _threshold("logit_max", ">", [round(10 ** (e / 20), 3) for e in range(0, 61)], (1, 3)),
}
"""qkwatch's detector families: rules of the collector's kinds, each candidate without its name."""


# --- the numpy replica of the collector's threshold and growth rules ---------------------------------------

_OPS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}


@dataclass(frozen=True)
class Grid:
    """One metric of one run: per layer, its measured values in report order, with their steps."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    """Per layer, ``(steps, values)`` of the reports that measured it (NaN and inf kept)."""


def grids(reports: Sequence[ReportValues], metric: str) -> Grid:
    """The per-layer series of ``metric`` over ``reports`` (one attempt, steps ascending)."""
    rows = sorted(reports, key=lambda r: (r.attempt, r.step))
    width = max((len(r.layers.get(metric) or []) for r in rows), default=0)
    out = []
    for layer in range(width):
        pairs = [
            (r.step, v)
            for r in rows
            if layer < len(r.layers.get(metric) or []) and (v := (r.layers.get(metric) or [])[layer]) is not None
        ]
        out.append((np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=float)))
    return Grid(tuple(out))


def _first_streak(holds: np.ndarray, n: int) -> int | None:
    """Index at which ``holds`` has first been true ``n`` times running."""
    if n == 1:
        hits = np.flatnonzero(holds)
        return int(hits[0]) if len(hits) else None
    count = np.cumsum(holds, dtype=np.int64)
    if len(count) < n:
        return None
    window = count[n - 1 :] - np.concatenate([[0], count[:-n]])
    hits = np.flatnonzero(window == n)
    return int(hits[0]) + n - 1 if len(hits) else None


def first_firing(rule: Mapping[str, Any], grid: Grid) -> int | None:
    """The step of the report at which the collector would first open an alert of ``rule`` (threshold
    or growth kind; :mod:`qkwatch.rules.transitions`), None when it never would."""
    found = []
    for steps, values in grid.layers:
        holds = _holds(rule, values)
        if holds is None:
            continue
        index = _first_streak(holds, int(rule.get("for_reports", 3)))
        if index is not None:
            found.append(int(steps[index]))
    return min(found) if found else None


def _holds(rule: Mapping[str, Any], values: np.ndarray) -> np.ndarray | None:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if rule.get("kind", "threshold") == "threshold":
            return ~np.isnan(values) & _OPS[rule["op"]](values, rule["threshold"])
        skip, size, factor = int(rule.get("skip_reports", 0)), int(rule.get("baseline_reports", 5)), rule["factor"]
        rest = values[skip:]
        finite = np.flatnonzero(np.isfinite(rest))
        if len(finite) < size:
            return None
        early = rest[finite[:size]]
        try:  # the collector's mean: finite even where the sum is not
            baseline = math.fsum(early) / size
        except OverflowError:
            baseline = math.fsum(v / size for v in early)
        if not baseline > 0:
            return None
        judged = np.zeros(len(values), dtype=bool)
        start = skip + int(finite[size - 1]) + 1  # the report that completes the baseline is not judged
        ratio = values[start:] / baseline
        judged[start:] = ~np.isnan(ratio) & (ratio >= factor if factor > 1 else ratio <= factor)
        return judged


# --- the one criterion ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """The chosen candidate of one family, with its tune numbers."""

    family: str
    index: int
    flagged: int
    bad: int
    false_alarms: int
    healthy: int
    median_first_firing: float | None


def choose(
    family: str,
    firings: Sequence[Mapping[str, int]],
    bad: Mapping[str, int],
    healthy: Sequence[str],
) -> Pick | None:
    """The candidate of ``family`` that :func:`criterion` puts first; None when every candidate alarms on a
    healthy run or flags nothing.

    ``firings[i]``: run -> first firing step of candidate i; ``bad``: the hot-side bad tune runs -> their
    outcome's step (a firing after it does not flag); ``healthy``: the healthy tune runs.
    """
    best: tuple[tuple[float, float, float, int], Pick] | None = None
    for i, fired in enumerate(firings):
        pick = _pick(family, i, fired, bad, healthy)
        if pick.false_alarms or not pick.flagged:
            continue
        key = (*criterion_key(pick), i)
        if best is None or key < best[0]:
            best = (key, pick)
    return None if best is None else best[1]


def _pick(family: str, i: int, fired: Mapping[str, int], bad: Mapping[str, int], healthy: Sequence[str]) -> Pick:
    early = [fired[run] for run, step in bad.items() if run in fired and fired[run] <= step]
    return Pick(
        family,
        i,
        len(early),
        len(bad),
        sum(1 for run in healthy if run in fired),
        len(healthy),
        statistics.median(early) if early else None,
    )


RECALL = 0.80
"""The share of the hot-side bad tune runs a candidate must flag before its earliness counts (the bar's)."""


def criterion_key(pick: Pick) -> tuple[float, float, float]:
    """Smaller is better (see the module docstring). Also how two families' choices compare: the tuned
    loss-only baseline is the loss family this puts first."""
    first = pick.median_first_firing if pick.median_first_firing is not None else math.inf
    if pick.flagged >= RECALL * pick.bad:
        return (0.0, first, -pick.flagged)
    return (1.0, -pick.flagged, first)
