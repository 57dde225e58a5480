"""Seed 001's analysis: the analogues of the paper's Tables 3, 4 and 5 and the layer roles, from the results.

The grid (depths x query-key initialisation regimes) and the interventions are the settings
``experiments.seed001`` trains; :func:`analyse` reads what they measured, and
:mod:`experiments.reproduction.seed001_section` makes the page's section from it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DEPTHS = (4, 6, 8)


REGIMES = ("independent_xavier", "disjoint_support_xavier", "qk_identical")


UNCOUPLED = ("independent_xavier", "disjoint_support_xavier")


INTERVENTIONS = ("none", "k_spectrum_clamp", "forced_k_contraction", "freeze_q", "freeze_k", "qk_align_reg")


PREDICTED = {"forced_k_contraction": -1, "k_spectrum_clamp": +1, "freeze_k": +1, "freeze_q": +1}
"""The paper's direction of the entropy change against the matched baseline (-1 sharpens, +1 softens)."""


FIT_FROM = 100
"""Slopes are fitted from this step on. In the first ~75 steps every participation ratio falls from
~38 (isotropic random projections) to ~5-9 as the model leaves its initialisation, a transient the
paper never sees: its first logged point is after epoch 1 (~4,400 steps of batch 64), longer than
these whole runs. Fitting from step 100 measures the trend after that transient."""


def _slope(steps: list[int], y: np.ndarray) -> float:
    """Least-squares slope per 100 steps over the reports from step FIT_FROM on."""
    x = np.asarray(steps, dtype=float)
    ok = np.isfinite(y) & (x >= FIT_FROM)
    if ok.sum() < 3:
        return math.nan
    return float(np.polyfit(x[ok] / 100.0, y[ok], 1)[0])


def layer_slopes(record: dict) -> list[dict[str, float]]:
    """Per layer of one run: slopes of PR_Q, PR_K, PR_Q - PR_K, QK^T erank, entropy and top-1."""
    out = []
    pq, pk = np.asarray(record["pr_q"]["values"]), np.asarray(record["pr_k"]["values"])
    steps = record["pr_q"]["steps"]
    for layer in range(pq.shape[1]):
        row = {
            "layer": layer,
            "pr_q": _slope(steps, pq[:, layer]),
            "pr_k": _slope(steps, pk[:, layer]),
            "pr_diff": _slope(steps, pq[:, layer] - pk[:, layer]),
        }
        for metric, key in (("qk_erank", "qk_erank"), ("attn_entropy_nats", "entropy"), ("attn_top1", "top1")):
            if metric in record:
                v = np.asarray(record[metric]["values"])[:, layer]
                # relative change: compression of the interaction spectrum is a fall of log erank
                row[key] = _slope(record[metric]["steps"], np.log(v) if metric == "qk_erank" else v)
        out.append(row)
    return out


def cells(results: dict) -> list[dict[str, Any]]:
    """Seed-averaged slopes per (regime, depth, layer): the paper's independence-respecting unit."""
    grid = [r for r in results["runs"] if r["kind"] == "grid"]
    out = []
    for regime in REGIMES:
        for depth in DEPTHS:
            runs = [r for r in grid if r["regime"] == regime and r["depth"] == depth]
            per_run = [layer_slopes(r) for r in runs]
            for layer in range(depth):
                cell = {"regime": regime, "depth": depth, "layer": layer}
                for key in per_run[0][layer]:
                    if key != "layer":
                        cell[key] = float(np.nanmean([p[layer][key] for p in per_run]))
                out.append(cell)
    return out


def _final_mean(record: dict, metric: str) -> float:
    return float(np.nanmean(record[metric]["values"][-1])) if metric in record else math.nan


def table3(results: dict) -> dict[str, Any]:
    from scipy import stats

    grid = [r for r in results["runs"] if r["kind"] == "grid"]
    rows = {}
    for regime in REGIMES:
        for depth in DEPTHS:
            runs = [r for r in grid if r["regime"] == regime and r["depth"] == depth]
            rows[f"{regime}/{depth}"] = {
                "val_loss": [r["val_loss"] for r in runs],
                "alignment_final": [_final_mean(r, "qk_cos") for r in runs],
                "alignment_initial": [float(np.nanmean(r["qk_cos"]["values"][0])) for r in runs],
            }
    coupled = [_final_mean(r, "qk_cos") for r in grid if r["regime"] == "qk_identical"]
    uncoupled = [_final_mean(r, "qk_cos") for r in grid if r["regime"] in UNCOUPLED]
    welch = stats.ttest_ind(coupled, uncoupled, equal_var=False)
    gap = {}
    for depth in DEPTHS:
        c = np.mean([_final_mean(r, "qk_cos") for r in grid if r["regime"] == "qk_identical" and r["depth"] == depth])
        u = max(
            np.mean([_final_mean(r, "qk_cos") for r in grid if r["regime"] == reg and r["depth"] == depth])
            for reg in UNCOUPLED
        )
        gap[depth] = float(c - u)
    return {
        "rows": rows,
        "welch_p": float(welch.pvalue),
        "welch_t": float(welch.statistic),
        "hedges_g": _hedges_g(coupled, uncoupled),
        "gap_by_depth": gap,
        "by_regime": {reg: [_final_mean(r, "qk_cos") for r in grid if r["regime"] == reg] for reg in REGIMES},
    }


def _hedges_g(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a), np.asarray(b)
    na, nb = len(a), len(b)
    pooled = math.sqrt(((na - 1) * a.var(ddof=1) + (nb - 1) * b.var(ddof=1)) / (na + nb - 2))
    d = (a.mean() - b.mean()) / pooled
    return float(d * (1 - 3 / (4 * (na + nb) - 9)))


def table4(results: dict) -> dict[str, Any]:
    from scipy import stats

    cs = cells(results)
    out: dict[str, Any] = {}
    for group, regimes in (("uncoupled", UNCOUPLED), ("coupled", ("qk_identical",)), ("all", REGIMES)):
        sel = [c for c in cs if c["regime"] in regimes]
        out[group] = {
            key: {
                "mean": float(np.nanmean([c[key] for c in sel])),
                "sd": float(np.nanstd([c[key] for c in sel], ddof=1)),
                "positive": int(sum(c[key] > 0 for c in sel)),
                "n": len(sel),
            }
            for key in ("pr_q", "pr_k", "pr_diff")
        }
    unc = [c for c in cs if c["regime"] in UNCOUPLED]
    spec = [-c["pr_k"] for c in unc]  # key specialisation: PR_K falling
    comp = [-c["qk_erank"] for c in unc]  # interaction compression: log erank falling
    sharp = [-c["entropy"] for c in unc]  # entropy sharpening
    top1 = [c["top1"] for c in unc]  # top-1 sharpening
    corr = {}
    for name, (x, y) in {
        "specialisation~compression": (spec, comp),
        "compression~entropy_sharpening": (comp, sharp),
        "compression~top1_sharpening": (comp, top1),
    }.items():
        r = stats.pearsonr(x, y)
        corr[name] = {"r": float(r.statistic), "p": float(r.pvalue), "n": len(x)}
    out["correlations"] = corr
    out["cells"] = cs
    return out


def roles(results: dict) -> dict[str, dict[str, float]]:
    """Final entropy (nats), top-1, QK^T erank and PR_Q of early / middle / upper thirds, uncoupled grid runs."""
    grid = [r for r in results["runs"] if r["kind"] == "grid" and r["regime"] in UNCOUPLED]
    parts: dict[str, dict[str, list[float]]] = {p: {} for p in ("early", "middle", "upper")}
    for r in grid:
        depth = r["depth"]
        for layer in range(depth):
            part = ("early", "middle", "upper")[min(2, int(3 * layer / depth))]
            for metric in ("attn_entropy_nats", "attn_top1", "qk_erank", "pr_q", "pr_k"):
                if metric in r:
                    parts[part].setdefault(metric, []).append(r[metric]["values"][-1][layer])
    return {p: {m: float(np.nanmean(v)) for m, v in d.items()} for p, d in parts.items()}


def table5(results: dict) -> dict[str, Any]:
    runs = [r for r in results["runs"] if r["kind"] == "intervention"]
    base = {r["seed"]: r for r in runs if r["intervention"] == "none"}
    out = {}
    for kind in INTERVENTIONS:
        sel = [r for r in runs if r["intervention"] == kind]
        row = {m: [_final_mean(r, m) for r in sel] for m in ("attn_entropy_nats", "logit_std", "qk_erank", "attn_top1")}
        row["val_loss"] = [r["val_loss"] for r in sel]
        if kind != "none":
            deltas = [
                _final_mean(r, "attn_entropy_nats") - _final_mean(base[r["seed"]], "attn_entropy_nats")
                for r in sel
                if r["seed"] in base
            ]
            direction = PREDICTED.get(kind) or (1 if np.mean(deltas) > 0 else -1)
            row["entropy_delta"] = deltas
            row["direction"] = direction
            row["predicted"] = kind in PREDICTED
            row["confidence"] = float(np.mean([np.sign(d) == direction for d in deltas])) if deltas else math.nan
        out[kind] = row
    return out


def analyse(results: dict) -> dict[str, Any]:
    return {"table3": table3(results), "table4": table4(results), "roles": roles(results), "table5": table5(results)}
