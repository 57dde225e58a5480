"""QKAI's scale, the computations: the random law, the metric's checks, correlated heads, the recipes.

What they compute is described in :mod:`experiments.qkai_scale`, which runs them with its settings,
reports the results (``headlines``, ``section``) and is the command line.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from qkwatch.agent.metrics.heads import split_heads
from qkwatch.agent.metrics.subspace import qkai

SEED = 7000
THRESHOLD = 0.70
SEED000_INIT = 0.31
SEED000_SHAPE = {"d_model": 2048, "d_head": 128, "n_heads": 16}
RECIPES = ("debug_cpu", "small_cpu", "collapse_cpu", "seed001_grid", "seed001_interventions", "gpt_1_3b", "gpt_6_7b")
REGIMES = ("default", "independent_xavier", "qk_identical", "disjoint_support_xavier")


# --- random heads --------------------------------------------------------------------------------


def _ranks(d_head: int) -> list[int]:
    return sorted({1, max(1, d_head // 8), d_head // 2, d_head})


def _heads_for(d: int, h: int, cfg: dict) -> int:
    return int(min(cfg["max_heads"], max(cfg["min_heads"], cfg["flop_budget"] // (3 * d * h * h))))


def _draw(n: int, d: int, h: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, d, h, generator=gen)


def _qkai_chunked(
    n: int, d: int, h: int, ranks: list[int], gen: torch.Generator, method: str = "exact"
) -> dict[int, np.ndarray]:
    """QKAI of ``n`` independent Gaussian head pairs for each rank, drawn in chunks of <= 64 MB per factor."""
    chunk = max(1, (1 << 24) // (d * h))
    out: dict[int, list[np.ndarray]] = {r: [] for r in ranks}
    done = 0
    while done < n:
        m = min(chunk, n - done)
        wq, wk = _draw(m, d, h, gen), _draw(m, d, h, gen)
        for r in ranks:
            out[r].append(qkai(wq, wk, r, method=method).double().numpy())
        done += m
    return {r: np.concatenate(v) for r, v in out.items()}


def numpy_qkai(wq: np.ndarray, wk: np.ndarray, r: int) -> float:
    """Independent QKAI of one head: top-r left-singular bases by numpy SVD, cosines by SVD of U_Q^T U_K."""
    uq = np.linalg.svd(wq.astype(np.float64), full_matrices=False)[0][:, :r]
    uk = np.linalg.svd(wk.astype(np.float64), full_matrices=False)[0][:, :r]
    c = np.linalg.svd(uq.T @ uk, compute_uv=False)
    return float(np.mean(c**2))


def random_law(cfg: dict, gen: torch.Generator) -> dict:
    rows = []
    for d in cfg["d_models"]:
        for h in cfg["d_heads"]:
            if h > d // 2:
                continue
            n = _heads_for(d, h, cfg)
            t0 = time.time()
            vals = _qkai_chunked(n, d, h, _ranks(h), gen)
            wall = time.time() - t0
            for r, v in vals.items():
                pred = r / d
                mean, sd = float(v.mean()), float(v.std(ddof=1))
                se = sd / math.sqrt(v.size)
                rows.append(
                    {
                        "d_model": d,
                        "d_head": h,
                        "r": r,
                        "heads": int(v.size),
                        "mean": mean,
                        "sd": sd,
                        "se": se,
                        "sd_formula": random_sd(d, r),
                        "predicted": pred,
                        "rel_err": mean / pred - 1,
                        "rel_se": se / pred,
                        "z": (mean - pred) / se if se > 0 else 0.0,
                        "wall_s": wall / len(vals),
                    }
                )
    return {
        "rows": rows,
        "max_abs_z": max(abs(row["z"]) for row in rows),
        "max_abs_rel_err": max(abs(row["rel_err"]) for row in rows),
    }


def randomized_vs_exact(cfg: dict, gen: torch.Generator) -> list[dict]:
    """The metric's ``method="auto"`` (a randomised SVD where ``4 (r + 8) <= d_head``) on the same random heads.

    Gaussian weights have no spectral gap at the cut, which is where the randomised range finder is
    least accurate (the project documents its 1e-3 bound for gaps sigma_(r+1)/sigma_r <= 0.5).
    """
    out = []
    for d in cfg["d_models"]:
        h = max(x for x in cfg["d_heads"] if x <= d // 2)
        n = cfg["auto_heads"]
        wq, wk = _draw(n, d, h, gen), _draw(n, d, h, gen)
        for r in _ranks(h):
            if 4 * (r + 8) > h:
                continue
            exact = qkai(wq, wk, r, method="exact").double()
            auto = qkai(wq, wk, r, method="auto").double()
            out.append(
                {
                    "d_model": d,
                    "d_head": h,
                    "r": r,
                    "heads": n,
                    "predicted": r / d,
                    "exact_mean": float(exact.mean()),
                    "auto_mean": float(auto.mean()),
                    "max_abs_diff": float((auto - exact).abs().max()),
                    "mean_diff": float((auto - exact).mean()),
                }
            )
    return out


def numpy_check(gen: torch.Generator) -> dict:
    """``qkai`` against :func:`numpy_qkai` on a few heads at three shapes and every rank."""
    worst = 0.0
    cases = 0
    for d, h in ((64, 16), (256, 64), (1024, 128)):
        wq, wk = _draw(4, d, h, gen), _draw(4, d, h, gen)
        for r in _ranks(h):
            ours = qkai(wq, wk, r, method="exact").double().numpy()
            for i in range(4):
                worst = max(worst, abs(ours[i] - numpy_qkai(wq[i].numpy(), wk[i].numpy(), r)))
                cases += 1
    return {"max_abs_diff": worst, "cases": cases}


def layer_level(cfg: dict, gen: torch.Generator) -> list[dict]:
    """All heads of a layer concatenated, ``d_model x d_model``: top-r subspaces of the whole projections."""
    out = []
    for d in cfg["layer_d_models"]:
        rs = sorted({128 if d >= 256 else d // 4, round(SEED000_INIT * d), d // 2, d})
        vals: dict[int, list[float]] = {r: [] for r in rs}
        for _ in range(cfg["layer_draws"]):
            wq, wk = _draw(1, d, d, gen), _draw(1, d, d, gen)
            for r in rs:
                vals[r].append(float(qkai(wq, wk, r, method="exact")[0]))
        for r in rs:
            out.append(
                {
                    "d_model": d,
                    "r": r,
                    "draws": len(vals[r]),
                    "mean": float(np.mean(vals[r])),
                    "predicted": r / d,
                    "rel_err": float(np.mean(vals[r])) / (r / d) - 1,
                }
            )
    return out


def correlated(cfg: dict, gen: torch.Generator) -> dict:
    """QKAI of ``W_K = rho W_Q + sqrt(1 - rho^2) Z`` at seed 000's head shape, and the rho that reads 0.31."""
    d, h = SEED000_SHAPE["d_model"], SEED000_SHAPE["d_head"]
    n = cfg["rho_heads"]
    wq, z = _draw(n, d, h, gen), _draw(n, d, h, gen)
    rows = []
    for rho in cfg["rho"]:
        wk = rho * wq + math.sqrt(max(0.0, 1 - rho * rho)) * z
        rows.append({"rho": rho, "qkai": float(qkai(wq, wk, h, method="exact").double().mean())})
    xs, ys = [r["rho"] for r in rows], [r["qkai"] for r in rows]
    rho_031 = float(np.interp(SEED000_INIT, ys, xs)) if ys[0] < SEED000_INIT < ys[-1] else None
    return {"d_model": d, "d_head": h, "heads": n, "rows": rows, "rho_for_0.31": rho_031}


# --- the project's recipes ------------------------------------------------------------------------


def _recipe_qk(cfg, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_Q, W_K)`` of one layer in ``nn.Linear`` layout exactly as ``trainer.model.init.init_weights`` draws them.

    Regime layers come from ``trainer.model.init.qk_regime_weights``; the others are the default
    ``randn(shape, generator=generator(seed, name)) * init_std``. Checked against ``build_model``
    for the small recipes (``replication_exact``), so the 1.3B and 6.7B layers need no model.
    """
    from qkwatch.trainer.model.init import generator, qk_regime_weights

    mc = cfg.model_config()
    init = cfg.init
    wq_shape = (mc.n_heads * mc.d_head, mc.d_model)
    wk_shape = (mc.n_kv_heads * mc.d_head, mc.d_model)
    prefix = f"blocks.{layer}.attn."
    regime_layers = set(range(mc.n_layers) if init.qk_layers is None else init.qk_layers)
    if init.qk_regime != "default" and layer in regime_layers:
        return qk_regime_weights(init.qk_regime, wq_shape, wk_shape, mc.n_heads, mc.n_kv_heads, cfg.seed, prefix)
    wq = torch.randn(wq_shape, generator=generator(cfg.seed, prefix + "q_proj.weight")) * mc.init_std
    wk = torch.randn(wk_shape, generator=generator(cfg.seed, prefix + "k_proj.weight")) * mc.init_std
    return wq, wk


def _replication_exact(name: str) -> bool:
    from qkwatch.trainer.model.init import build_model
    from qkwatch.trainer.run import recipes

    cfg = recipes.get(name)
    model = build_model(cfg.model_config(), cfg.init, cfg.seed, torch.device("cpu"))
    for i, attn in enumerate(model.attentions()):
        wq, wk = _recipe_qk(cfg, i)
        if not (torch.equal(wq, attn.q_proj.weight.detach()) and torch.equal(wk, attn.k_proj.weight.detach())):
            return False
    return True


def recipes_at_init(cfg: dict) -> dict:
    from qkwatch.trainer.model.init import qk_regime_weights
    from qkwatch.trainer.run import recipes

    gen = torch.Generator().manual_seed(SEED + 1)
    out: dict[str, Any] = {}
    for name in RECIPES:
        rc = recipes.get(name)
        mc = rc.model_config()
        n_layers = mc.n_layers if cfg["recipe_layers"] is None else min(mc.n_layers, cfg["recipe_layers"])
        per_layer = []
        for i in range(n_layers):
            wq, wk = _recipe_qk(rc, i)
            v = qkai(split_heads(wq, mc.n_heads), split_heads(wk, mc.n_kv_heads), method="exact").double()
            per_layer.append({"mean": float(v.mean()), "max": float(v.max())})
        regimes = {}
        wq_shape = (mc.n_heads * mc.d_head, mc.d_model)
        wk_shape = (mc.n_kv_heads * mc.d_head, mc.d_model)
        for regime in REGIMES:
            if regime == "default":
                wq, wk = torch.randn(wq_shape, generator=gen), torch.randn(wk_shape, generator=gen)
            else:
                wq, wk = qk_regime_weights(
                    regime, wq_shape, wk_shape, mc.n_heads, mc.n_kv_heads, SEED, "blocks.0.attn."
                )
            v = qkai(split_heads(wq, mc.n_heads), split_heads(wk, mc.n_kv_heads), method="exact").double()
            regimes[regime] = {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
        base = mc.d_head / mc.d_model
        out[name] = {
            "d_model": mc.d_model,
            "d_head": mc.d_head,
            "n_heads": mc.n_heads,
            "n_layers": mc.n_layers,
            "init": {"qk_regime": rc.init.qk_regime, "qk_layers": rc.init.qk_layers},
            "layers_measured": n_layers,
            "per_layer": per_layer,
            "regimes": regimes,
            "random_baseline": base,
            "threshold": threshold_terms(mc.d_model, mc.d_head),
        }
    out["replication_exact"] = {name: _replication_exact(name) for name in ("debug_cpu", "small_cpu")}
    return out


def random_sd(d: int, r: int) -> float:
    """Standard deviation of one head's QKAI for independent uniformly random r-dim subspaces of R^d.

    ``var(tr(P_Q P_K)) = 2 r^2 (d - r)^2 / (d^2 (d - 1)(d + 2))`` for two independent rank-r projections,
    so ``sd(QKAI) = sqrt(2) (d - r) / (d sqrt((d - 1)(d + 2)))``, about ``sqrt(2) / d`` for ``r << d``
    (the measured standard deviations are recorded next to it).
    """
    return math.sqrt(2) * (d - r) / (d * math.sqrt((d - 1) * (d + 2)))


def threshold_terms(d: int, h: int, sd_random: float | None = None) -> dict:
    """The 0.70 alert threshold (and seed 000's 0.31) at one head shape, in the random law's units."""
    base = h / d
    sd = sd_random if sd_random is not None else random_sd(d, h)
    return {
        "random_baseline": base,
        "threshold_multiple_of_baseline": THRESHOLD / base,
        "threshold_excess_fraction": (THRESHOLD - base) / (1 - base),
        "threshold_z": (THRESHOLD - base) / sd,
        "threshold_equivalent_random_r": THRESHOLD * d,
        "seed000_init_multiple": SEED000_INIT / base,
        "seed000_init_equivalent_random_r": SEED000_INIT * d,
        "sd_random": sd,
    }
