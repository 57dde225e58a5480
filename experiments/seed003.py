"""Seed 003 ("Mind the Gap") at initialisation: rank collapse in width, the spectral gap, depth.

``python -m experiments.seed003 [--quick]`` computes, on one CPU thread, and writes
``experiments/results/seed003.json``:

* **(a) width.** One softmax attention layer on isotropic inputs: ``X`` has orthonormal rows times
  a token scale (``T <= d`` always: ``d`` is fixed at the largest ``T``, or ``d = T``), ``W_Q``,
  ``W_K``, ``W_V`` i.i.d. Gaussian with variance ``1/d``, ``A = softmax(X W_Q W_K^T X^T / sqrt(d))``
  (non-causal as in the paper, and causal as in our models). For each context length ``T`` and
  several draws: the stable rank of the output ``Y = A X W_V`` and of its covariance
  ``C = Y^T Y`` (the paper's ``||C||_F^2 / ||C||_2^2``), with ``A`` and with ``A - U`` (``U = 1 1^T / T``,
  causal: ``1 / (i + 1)`` on the visible keys), and ``sigma_1(A)``, ``sigma_2(A)`` and the gap. The
  attention matrix's own stable rank and gap come from the project's ``attention_spectrum``,
  checked against an independent numpy SVD.
* **(b) depth.** ``L = 1..12`` layers ``X_{l+1} = g A_l X_l W_l``, no residual, no LayerNorm,
  orthogonal ``W_l``: the paper's i.i.d. Markov network (``A_l`` the softmax of i.i.d. N(0, 1)
  logits, independent of ``X``) and real attention (fresh ``W_Q``, ``W_K`` per layer, logits from
  ``X_l``), with and without the outlier, at gain ``g = 1`` and at the gain that makes the
  outlier-free layer norm-preserving. Measured: ``||d <R, X_L> / d X_0||_F^2`` by autograd for a fixed
  random readout ``R``, and the stable rank of ``X_L``.
* **(c) the project's model.** ``trainer``'s GPT at initialisation (the ``small_cpu`` shape, GPT-2
  init) in the ``vanilla`` and ``outlier_removed`` variants: the agent's ``attn_srank`` and
  ``attn_gap1`` (causal, from the queries and keys the model uses) against the context length.

The computations are in :mod:`experiments.reproduction.seed003_math` (width, depth) and
:mod:`experiments.reproduction.seed003_model` (the project's model), the section of docs/reproduction.md
in :mod:`experiments.reproduction.seed003_section`; this module holds the settings, runs them (``run``),
says the headlines and is the command line.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from experiments.common import at_init_main, at_init_run
from experiments.reproduction.seed003_math import SEED, SERIES, depth, numpy_spectrum_check, width
from experiments.reproduction.seed003_model import model_at_init
from experiments.reproduction.seed003_section import fmt_na

NAME = "seed003"
RESULTS = Path(__file__).resolve().parent / "results" / f"{NAME}.json"

FULL = {
    "width_T": [16, 32, 64, 128, 256, 512, 1024],
    "width_d": 1024,
    "width_draws": {"16": 16, "32": 16, "64": 12, "128": 8, "256": 6, "512": 4, "1024": 4},
    "depth_T": 256,
    "depth_d": 256,
    "depth_L": 12,
    "depth_draws": 4,
    "model_recipe": "small_cpu",
    "model_T": [16, 32, 64, 128, 256, 512],
}
QUICK = {
    "width_T": [16, 32, 64, 128, 256],
    "width_d": 256,
    "width_draws": {"16": 4, "32": 4, "64": 3, "128": 3, "256": 2},
    "depth_T": 32,
    "depth_d": 32,
    "depth_L": 6,
    "depth_draws": 2,
    "model_recipe": "small_cpu",
    "model_T": [16, 64],
}

__all__ = [
    "FULL",
    "NAME",
    "QUICK",
    "RESULTS",
    "SEED",
    "SERIES",
    "depth",
    "headlines",
    "main",
    "model_at_init",
    "numpy_spectrum_check",
    "run",
    "width",
]


# --- run / headlines / main ----------------------------------------------------------------------


def run(quick: bool = False) -> dict:
    """Every part of the experiment, at the ``QUICK`` or ``FULL`` settings, on one CPU thread."""
    return at_init_run(NAME, quick, QUICK if quick else FULL, SEED, _parts)


def _parts(results: dict, cfg: dict, gen: torch.Generator) -> None:
    results["dtype"] = "float64"
    t0 = time.time()
    results["width"] = width(cfg, gen)
    results["width"]["wall_s"] = time.time() - t0
    t0 = time.time()
    results["depth"] = depth(cfg, gen)
    results["depth"]["wall_s"] = time.time() - t0
    t0 = time.time()
    results["model"] = model_at_init(cfg)
    results["model"]["wall_s"] = time.time() - t0


def headlines(results: dict) -> list[str]:
    w, dp, m = results["width"], results["depth"], results["model"]
    ts = w["T"]
    t_hi = str(ts[-1])
    ln = w["results"]["ln_full"]
    fl, fp = w["fits"]["ln_full"], w["fits"]["prop_full"]
    runs = dp["runs"]
    lines = [
        f"width, logit var 1 (d={w['d_fixed']}): covariance stable rank with outlier "
        f"{ln['with'][str(ts[0])]['cov_srank']['mean']:.4f} (T={ts[0]}) -> {ln['with'][t_hi]['cov_srank']['mean']:.4f} "
        f"(T={t_hi}), sr-1 ~ T^{fl['slope_cov_srank_excess_with']:.2f}",
        f"width, logit var 1: without outlier {ln['removed'][str(ts[0])]['cov_srank']['mean']:.2f} -> "
        f"{ln['removed'][t_hi]['cov_srank']['mean']:.2f}, log-log slope {fl['slope_cov_srank_removed']:.2f}",
        f"width, d=T, logit var 1/T: sr-1 ~ T^{fp['slope_cov_srank_excess_with']:.2f} (paper: T^-3); without outlier "
        f"slope {fp['slope_cov_srank_removed']:.2f}",
        f"width, logit var 1: sigma1(A) {ln['with'][t_hi]['sigma1']['mean']:.4f}, gap {ln['with'][t_hi]['gap']['mean']:.3f} "
        f"at T={t_hi}",
        f"depth, i.i.d. Markov, g=1: ln|grad|^2 slope per layer with outlier "
        f"{fmt_na(runs['markov_g1_with']['slope_ln_grad2_per_layer'], '+.2f')}, without "
        f"{fmt_na(runs['markov_g1_removed']['slope_ln_grad2_per_layer'], '+.2f')} (predicted 0, "
        f"{-dp['predicted_slope_gap']:+.2f})",
        f"depth, i.i.d. Markov, bulk gain {dp['bulk_gain']:.2f}: with outlier "
        f"{fmt_na(runs['markov_gbulk_with']['slope_ln_grad2_per_layer'], '+.2f')}, without "
        f"{fmt_na(runs['markov_gbulk_removed']['slope_ln_grad2_per_layer'], '+.2f')} (predicted "
        f"{dp['predicted_slope_gap']:+.2f}, 0)",
        f"model ({m['recipe']}, causal) at T={m['T'][-1]}: attn_srank vanilla "
        f"{m['vanilla'][str(m['T'][-1])]['attn_srank']:.2f}, outlier_removed "
        f"{m['outlier_removed'][str(m['T'][-1])]['attn_srank']:.2f}; attn_gap1 vanilla "
        f"{m['vanilla'][str(m['T'][-1])]['attn_gap1']:.3f}",
        f"attention_spectrum vs numpy SVD: max discrepancy {fmt_na(w['numpy_check_max'], '.1e')}",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    return at_init_main(NAME, __doc__, run, headlines, argv)


if __name__ == "__main__":
    raise SystemExit(main())
