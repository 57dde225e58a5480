"""Seed 003's computations: the width sweep and the depth sweep (the project's model: ``seed003_model``).

What they compute is described in :mod:`experiments.seed003`, which runs them (``run``) with its
settings, says the headlines and is the command line.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from qkwatch.agent.metrics.attention import attention_spectrum

SEED = 3003

SERIES = {
    "ln": "d fixed, tokens of norm sqrt(d) (LayerNorm scale): logit variance 1",
    "unit": "d fixed, unit-norm tokens (the literal orthonormal rows): logit variance 1/d^2",
    "prop": "d = T, logit variance 1/d = 1/T",
}


# --- (a) width -----------------------------------------------------------------------------------


def _orthonormal_rows(t: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, t, generator=gen, dtype=torch.float64))
    return q.T.contiguous()  # (T, d), X X^T = I_T


def uniform_attention(t: int, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.full((t, t), 1.0 / t, dtype=torch.float64)
    return torch.ones(t, t, dtype=torch.float64).tril() / torch.arange(1, t + 1, dtype=torch.float64)[:, None]


def _softmax(logits: torch.Tensor, causal: bool) -> torch.Tensor:
    if causal:
        mask = torch.ones_like(logits, dtype=torch.bool).tril()
        logits = logits.masked_fill(~mask, -math.inf)
    return torch.softmax(logits, -1)


def _output_ranks(y: torch.Tensor) -> dict[str, float]:
    """Stable rank of ``Y`` and of ``C = Y^T Y``; ``cov_srank_excess = sum_{i>=2} lambda_i^2 / lambda_1^2``."""
    lam = torch.linalg.svdvals(y).square()  # eigenvalues of C, descending
    return {
        "out_srank": float(lam.sum() / lam[0]),
        "cov_srank": float(lam.square().sum() / lam[0].square()),
        "cov_srank_excess": float(lam[1:].square().sum() / lam[0].square()),
    }


def _width_draw(
    t: int, d: int, gen: torch.Generator, scales: dict[str, float], causal_series: set[str], check: bool
) -> dict[str, dict[str, dict[str, float]]]:
    """One draw of ``X, W_Q, W_K, W_V``; every series in ``scales`` is a logit scale on the same draw.

    ``g_q = X W_Q sqrt(d)`` has i.i.d. N(0, 1) entries (orthonormal rows, Gaussian weights), so the
    logits ``s * g_q g_k^T / sqrt(d)`` have variance ``s^2``; ``s = 1`` is LayerNorm-scale tokens with
    ``N(0, 1/d)`` weights, ``s = 1/d`` unit-norm tokens with the same weights.
    """
    x = _orthonormal_rows(t, d, gen)
    wq, wk, wv = (torch.randn(d, d, generator=gen, dtype=torch.float64) for _ in range(3))
    gq, gk = x @ wq, x @ wk  # (T, d), i.i.d. N(0, 1)
    xv = x @ wv / math.sqrt(d)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for series, s in scales.items():
        for causal in (False, True) if series in causal_series else (False,):
            key = f"{series}_{'causal' if causal else 'full'}"
            a = _softmax(s * gq @ gk.T / math.sqrt(d), causal)
            u = uniform_attention(t, causal)
            q_in = s * gq  # attention_spectrum divides q.k by sqrt(d_head = d) itself
            row: dict[str, dict[str, float]] = {}
            for removed in (False, True):
                m = a - u if removed else a
                sv = torch.linalg.svdvals(m)
                spec = attention_spectrum(q_in, gk, causal=causal, remove_outlier=removed)
                own_srank = float(sv.square().sum() / sv[0].square())
                own_gap = float(sv[0] - sv[1])
                rec = {
                    "sigma1": float(sv[0]),
                    "sigma2": float(sv[1]),
                    "gap": own_gap,
                    "attn_srank": float(spec["attn_srank"]),
                    "attn_gap1": float(spec["attn_gap1"]),
                    "fro2": float(m.square().sum()),
                    "spectrum_vs_svd": max(
                        abs(float(spec["attn_srank"]) - own_srank) / own_srank, abs(float(spec["attn_gap1"]) - own_gap)
                    ),
                    **_output_ranks(m @ xv),
                }
                if check:
                    rec["numpy_check"] = numpy_spectrum_check(
                        q_in.numpy(), gk.numpy(), causal, removed, rec["attn_srank"], rec["attn_gap1"]
                    )
                row["removed" if removed else "with"] = rec
            out[key] = row
    return out


def numpy_spectrum_check(q: np.ndarray, k: np.ndarray, causal: bool, removed: bool, srank: float, gap: float) -> float:
    """Largest discrepancy between ``attention_spectrum``'s values and a plain numpy SVD of the same matrix.

    Relative for the stable rank, absolute for the gap (which can be ~0 for ``A - U``).
    """
    t, dh = q.shape
    logits = (q @ k.T) / np.sqrt(dh)
    allowed = np.tril(np.ones((t, t), dtype=bool)) if causal else np.ones((t, t), dtype=bool)
    logits = np.where(allowed, logits, -np.inf)
    logits = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    a = e / e.sum(axis=1, keepdims=True)
    if removed:
        a = a - allowed / allowed.sum(axis=1, keepdims=True)
    s = np.linalg.svd(a, compute_uv=False)
    np_srank = float((s**2).sum() / s[0] ** 2)
    np_gap = float(s[0] - s[1])
    return max(abs(srank - np_srank) / np_srank, abs(gap - np_gap))


def _mean_sd(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "sd": float(arr.std(ddof=1)) if arr.size > 1 else 0.0}


def fit_loglog(ts: list[int], ys: list[float]) -> float:
    """Slope of ``log y`` against ``log T`` (least squares)."""
    x, y = np.log(np.asarray(ts, dtype=np.float64)), np.log(np.asarray(ys, dtype=np.float64))
    return float(np.polyfit(x, y, 1)[0])


def width(cfg: dict, gen: torch.Generator) -> dict:
    d_fixed = cfg["width_d"]
    per: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    checks: list[float] = []
    spec_diffs: list[float] = []
    for t in cfg["width_T"]:
        draws = cfg["width_draws"][str(t)]
        raw: dict[str, dict[str, dict[str, list[float]]]] = {}
        for i in range(draws):
            check = i == 0 and t == cfg["width_T"][2]  # one matrix per series/mask/variant through numpy
            fixed = _width_draw(t, d_fixed, gen, {"ln": 1.0, "unit": 1.0 / d_fixed}, {"ln"}, check)
            prop = _width_draw(t, t, gen, {"prop": 1.0 / math.sqrt(t)}, set(), check)
            for key, row in {**fixed, **prop}.items():
                for variant, rec in row.items():
                    if "numpy_check" in rec:
                        checks.append(rec.pop("numpy_check"))
                    spec_diffs.append(rec.pop("spectrum_vs_svd"))
                    bucket = raw.setdefault(key, {}).setdefault(variant, {})
                    for name, value in rec.items():
                        bucket.setdefault(name, []).append(value)
        for key, row in raw.items():
            for variant, metrics in row.items():
                per.setdefault(key, {}).setdefault(variant, {})[str(t)] = {
                    name: _mean_sd(values) for name, values in metrics.items()
                }
    ts = cfg["width_T"]
    fits = {}
    for key, row in per.items():

        def m(variant: str, name: str, row=row) -> list[float]:
            return [row[variant][str(t)][name]["mean"] for t in ts]

        fits[key] = {
            "slope_cov_srank_removed": fit_loglog(ts, m("removed", "cov_srank")),
            "slope_out_srank_removed": fit_loglog(ts, m("removed", "out_srank")),
            "slope_attn_srank_removed": fit_loglog(ts, m("removed", "attn_srank")),
            "slope_cov_srank_excess_with": fit_loglog(ts, m("with", "cov_srank_excess")),
            "cov_srank_removed_ratio_last_first": m("removed", "cov_srank")[-1] / m("removed", "cov_srank")[0],
        }
    return {
        "series": SERIES,
        "d_fixed": d_fixed,
        "T": ts,
        "draws": cfg["width_draws"],
        "results": per,
        "fits": fits,
        "numpy_check_max": max(checks) if checks else None,
        "spectrum_vs_torch_svd_max": max(spec_diffs),
    }


# --- (b) depth -----------------------------------------------------------------------------------


def _bulk_gain(t: int, gen: torch.Generator, samples: int = 16) -> tuple[float, float]:
    """``g = sqrt(T / E||A - U||_F^2)`` for i.i.d. N(0, 1) logits: the outlier-free layer preserves the norm."""
    u = uniform_attention(t, False)
    fro2 = [
        float((torch.softmax(torch.randn(t, t, generator=gen, dtype=torch.float64), -1) - u).square().sum())
        for _ in range(samples)
    ]
    f = float(np.mean(fro2))
    return math.sqrt(t / f), f


def _depth_draw(net: str, removed: bool, gain: float, t: int, d: int, n_layers: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)  # same seed with and without the outlier: paired draws
    x0 = (_orthonormal_rows(t, d, gen) * math.sqrt(d)).requires_grad_(True)
    readout = torch.randn(t, d, generator=gen, dtype=torch.float64)
    u = uniform_attention(t, False)
    x = x0
    grads, cov, out, closed = [], [], [], []
    mats = []
    for _ in range(n_layers):
        if net == "markov":
            a = torch.softmax(torch.randn(t, t, generator=gen, dtype=torch.float64), -1)
        else:
            wq = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
            wk = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
            a = torch.softmax((x @ wq) @ (x @ wk).T / math.sqrt(d), -1)
        if removed:
            a = a - u
        wv, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        x = gain * a @ x @ wv
        (grad,) = torch.autograd.grad((readout * x).sum(), x0, retain_graph=True)
        grads.append(float(grad.square().sum()))
        ranks = (
            _output_ranks(x.detach())
            if bool(x.detach().abs().max() > 0)
            else {"cov_srank": math.nan, "out_srank": math.nan}
        )
        cov.append(ranks["cov_srank"])
        out.append(ranks["out_srank"])
        if net == "markov":  # the network is linear in X: the gradient is R W^T ... pulled back through A^T
            mats.append(gain * a.detach())
            m = readout
            for am in reversed(mats):
                m = am.T @ m  # orthogonal W's drop out of the Frobenius norm
            closed.append(float(m.square().sum()))
    rec = {"grad2": grads, "cov_srank": cov, "out_srank": out}
    if closed:
        rec["closed_form_rel_err"] = max(abs(g - c) / c for g, c in zip(grads, closed, strict=True) if c > 0)
    return rec


def _slope_per_layer(log_g: list[float], first: int = 2) -> dict[str, Any]:
    """Least-squares slope of ``ln ||grad||^2`` per layer over ``L >= first`` up to the first non-finite value."""
    ls = []
    for i in range(first - 1, len(log_g)):
        if not math.isfinite(log_g[i]):
            break
        ls.append(i + 1)
    if len(ls) < 3:
        return {"slope": None, "fitted_layers": ls}
    return {"slope": float(np.polyfit(ls, [log_g[i - 1] for i in ls], 1)[0]), "fitted_layers": ls}


def _nanmean0(rows: list[list[float]]) -> list[float | None]:
    """Column means ignoring NaN (a layer whose output underflowed to 0 has no stable rank); None if all NaN."""
    arr = np.asarray(rows, dtype=np.float64)
    ok = np.isfinite(arr)
    counts = ok.sum(0)
    sums = np.where(ok, arr, 0.0).sum(0)
    return [float(s / c) if c else None for s, c in zip(sums, counts, strict=True)]


def depth(cfg: dict, gen: torch.Generator) -> dict:
    t, d, n_layers, draws = cfg["depth_T"], cfg["depth_d"], cfg["depth_L"], cfg["depth_draws"]
    g_bulk, fro2 = _bulk_gain(t, gen)
    gains = {"1": 1.0, "bulk": g_bulk}
    out: dict[str, Any] = {}
    closed_errs = []
    for net in ("markov", "attention"):
        for gain_name, gain in gains.items():
            for removed in (False, True):
                recs = [_depth_draw(net, removed, gain, t, d, n_layers, SEED + 100 * i) for i in range(draws)]
                closed_errs += [r["closed_form_rel_err"] for r in recs if "closed_form_rel_err" in r]
                g2 = np.asarray([r["grad2"] for r in recs])  # (draws, L)
                dead = ~(np.isfinite(g2) & (g2 > 0))  # exactly 0 (the output became exactly 0), or overflow
                with np.errstate(divide="ignore"):
                    logs = np.where(dead, np.nan, np.log(np.where(dead, 1.0, g2)))
                # geometric mean over the draws whose gradient is still nonzero; the slope stops where any draw died
                live = [float(np.mean(col[np.isfinite(col)])) if np.isfinite(col).any() else math.nan for col in logs.T]
                fit = _slope_per_layer([v if not dead[:, i].any() else math.nan for i, v in enumerate(live)])
                zero_from = next((i + 1 for i in range(dead.shape[1]) if dead[:, i].any()), None)
                out[f"{net}_g{gain_name}_{'removed' if removed else 'with'}"] = {
                    "net": net,
                    "gain": gain,
                    "removed": removed,
                    "ln_grad2": [v if math.isfinite(v) else None for v in live],
                    "grad2_zero_from_layer": zero_from,
                    "draws_zero": [int(k) for k in dead.sum(0)],
                    "draws_zero_last": int(dead[:, -1].sum()),
                    "cov_srank": _nanmean0([r["cov_srank"] for r in recs]),
                    "out_srank": _nanmean0([r["out_srank"] for r in recs]),
                    "slope_ln_grad2_per_layer": fit["slope"],
                    "slope_fitted_layers": fit["fitted_layers"],
                }
    predicted = math.log(t / fro2)
    return {
        "T": t,
        "d": d,
        "layers": n_layers,
        "draws": draws,
        "bulk_gain": g_bulk,
        "fro2_A_minus_U": fro2,
        "predicted_slope_gap": predicted,
        "predicted": {
            "markov_g1_with": 0.0,
            "markov_g1_removed": -predicted,
            "markov_gbulk_with": predicted,
            "markov_gbulk_removed": 0.0,
        },
        "closed_form_rel_err_max": max(closed_errs) if closed_errs else None,
        "runs": out,
    }
