"""Seed 000's variants, and what its runs say: per variant the headline numbers, and RAA's hold of the band.

``experiments.seed000`` trains the variants and logs :func:`summary`; its section of the page
(:mod:`experiments.reproduction.seed000_section`) is made from :func:`summary` and :func:`balance`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from experiments.common import last

VARIANTS: dict[str, list[str]] = {
    "vanilla": [],
    "par": ["raa.enabled=true", "raa.rotation=false", "raa.scheduling=false"],
    "rotation": ["raa.enabled=true", "raa.par=false"],
    "par_rotation": ["raa.enabled=true", "raa.scheduling=false"],
    "raa": ["raa.enabled=true"],
    "qk_norm": ["model.variant=qk_norm"],
    "sigma_reparam": ["model.variant=sigma_reparam"],
}
"""Seed 000's ablation and its two peers, as ``--set`` overrides (``experiments.seed000`` says what each
is), in the order the page lists them."""
EVALS_SHOWN = [
    *(f"passkey{n}_{score}_{length}" for score in ("acc", "digits") for n, length in ((1, 128), (1, 256), (5, 256))),
    "ppl_128",
    "ppl_256",
]
"""The evaluations the page shows: the passkey's exact and digit accuracy where it was measured (one needle at
128 and 256 tokens, five at 256 only), and the perplexity at both lengths."""


def _at(record: dict, metric: str, step: int) -> float:
    m = record.get(metric)
    if not m:
        return math.nan
    for s, v in zip(m["steps"], m["band"], strict=True):
        if s >= step:
            return v
    return math.nan


def _final(record: dict, metric: str, part: str = "band") -> float:
    m = record.get(metric)
    return m[part][-1] if m else math.nan


def by_variant(results: dict) -> dict[str, list[dict]]:
    """Runs per variant, in VARIANTS' order (the results' JSON has its keys sorted)."""
    out: dict[str, list[dict]] = {v: [] for v in sorted(results["variants"], key=variant_order)}
    for r in results["runs"]:
        out[r["variant"]].append(r)
    return out


def _trajectory(records: list[dict], metric: str) -> tuple[list[int], np.ndarray]:
    """The seed-mean band trajectory of ``metric`` (the seeds report at the same steps)."""
    runs = [r[metric] for r in records if r.get(metric)]
    if not runs:
        return [], np.array([])
    n = min(len(m["band"]) for m in runs)
    return runs[0]["steps"][:n], np.nanmean([m["band"][:n] for m in runs], axis=0)


def _lowest(records: list[dict], metric: str, after: int) -> tuple[float, float]:
    """The lowest value of the seed-mean band trajectory from step ``after`` on, and its step."""
    steps, values = _trajectory(records, metric)
    late = [i for i, s in enumerate(steps) if s >= after and math.isfinite(values[i])]
    if not late:
        return math.nan, math.nan
    i = min(late, key=lambda i: values[i])
    return float(values[i]), float(steps[i])


def last_val_loss(record: dict) -> float:
    return last((record["val_loss"]["steps"], record["val_loss"]["values"])) if "val_loss" in record else math.nan


def _mean_from(record: dict, metric: str, step: int) -> float:
    """The mean of ``record``'s band ``metric`` over the reports at ``step`` and after."""
    m = record.get(metric)
    v = [x for s, x in zip(m["steps"], m["band"], strict=True) if s >= step] if m else []
    return float(np.mean(v)) if v else math.nan


def balance(results: dict) -> dict[str, Any]:
    """RAA's hold of the induced band, predicted from the two penalties and measured at full strength.

    Per band head, with ``S = sum_i c_i^2 = r QKAI``, PAR adds ``lambda ReLU(S - tau)^2``
    (``tau = tau_factor r``, qkwatch/trainer/model/rank_anchored.py) and ``qk_collapse`` adds ``mu ReLU(target ramp r - S)^2``
    (qkwatch/trainer/run/interventions.py). Between ``tau`` and ``target ramp r`` both act, and the derivative of
    their sum in ``S``, ``2 lambda (S - tau) - 2 mu (target ramp r - S)``, vanishes at
    ``S / r = (lambda tau_factor + mu target ramp) / (lambda + mu)``: the penalties alone hold the
    band there, whatever RAA does otherwise. ``lambda`` is the schedule's for the band's measured
    entropy, ``lambda_0 sigmoid((H - h_star) / beta)``, for full RAA, and ``lambda_0`` for the
    unscheduled ablations (``par``, ``par_rotation``); the weights are collapse_cpu's
    (qkwatch/trainer/run/recipes.py), the recipe these results were trained with.
    """
    from qkwatch.contract.scheduling import sigmoid
    from qkwatch.trainer.run.recipes import collapse_cpu

    cfg = collapse_cpu()
    schedule, pressure = cfg.raa.schedule, cfg.intervention
    full = pressure.collapse_start + pressure.collapse_ramp
    by = by_variant(results)
    runs = by["raa"]
    entropy = float(np.mean([_mean_from(r, "attn_entropy", full) for r in runs]))
    share = sigmoid((entropy - schedule.h_star) / schedule.beta)
    lam, mu = share * schedule.lambda_0, pressure.collapse_align

    def point(lam: float) -> float:
        return (lam * cfg.raa.tau_factor + mu * pressure.collapse_target) / (lam + mu)

    fixed = {v: [_mean_from(r, "qkai", full) for r in by[v]] for v in ("par", "par_rotation") if by.get(v)}
    return {
        "full_from": full,
        "entropy": entropy,
        "share": share,
        "lambda_0": schedule.lambda_0,
        "mu": mu,
        "tau_factor": cfg.raa.tau_factor,
        "target": pressure.collapse_target,
        "h_star": schedule.h_star,
        "beta": schedule.beta,
        "predicted": point(lam),
        "measured": [_mean_from(r, "qkai", full) for r in runs],
        "seeds": [r["seed"] for r in runs],
        "predicted_fixed": point(schedule.lambda_0),
        "measured_fixed": fixed,
    }


def _flagged_fraction(record: dict, late: bool = False) -> float:
    """The mean fraction of layers RAA's schedule flagged, over the run or its second half."""
    if "raa_flagged_fraction" not in record:
        return math.nan
    v = record["raa_flagged_fraction"]["values"]
    return float(np.mean(v[len(v) // 2 :] if late else v))


def summary(results: dict) -> dict[str, dict[str, float]]:
    """Per variant, the seed-mean of each headline number."""
    rows = {}
    for variant, records in by_variant(results).items():

        def avg(fn, records=records):
            v = [fn(r) for r in records]
            v = [x for x in v if x is not None and math.isfinite(x)]
            return float(np.mean(v)) if v else math.nan

        rows[variant] = {
            "qkai_onset": avg(lambda r: _at(r, "qkai", results["onset"])),
            "qkai_final": avg(lambda r: _final(r, "qkai")),
            "qkai_peak": avg(lambda r: max(r["qkai"]["band"]) if r.get("qkai") else math.nan),
            "qkai_outside_final": avg(lambda r: _final(r, "qkai", "outside")),
            "srank_final": avg(lambda r: _final(r, "stable_rank")),
            "srank_onset": avg(lambda r: _at(r, "stable_rank", results["onset"])),
            **dict(
                zip(("srank_low", "srank_low_step"), _lowest(records, "stable_rank", results["onset"]), strict=True)
            ),
            "entropy_final": avg(lambda r: _final(r, "attn_entropy")),
            "entropy_outside_final": avg(lambda r: _final(r, "attn_entropy", "outside")),
            "qk_erank_final": avg(lambda r: _final(r, "qk_erank")),
            "val_loss": avg(last_val_loss),
            "flagged": avg(_flagged_fraction),
            "flagged_late": avg(lambda r: _flagged_fraction(r, late=True)),
            **{k: avg(lambda r, k=k: r["evals"].get(k, math.nan)) for k in EVALS_SHOWN},
        }
    return rows


def variant_order(variant: str) -> int:
    return list(VARIANTS).index(variant) if variant in VARIANTS else len(VARIANTS)
