"""QKAI's scale: what the query-key alignment index reads for random weights, and what 0.70 means.

``python -m experiments.qkai_scale [--quick]`` computes, on one CPU thread, and writes
``experiments/results/qkai_scale.json``:

* **the random law.** For independent Gaussian ``W_Q``, ``W_K`` (``d_model x d_head`` per head), the
  project's ``agent.metrics.qkai`` (exact method) against ``r / d_model`` over d_model 64..2048,
  d_head 16..128 and r from 1 to d_head, with the standard error of the mean from the number of
  heads drawn; an independent numpy computation (QR / SVD bases, principal angles) checks the metric.
* **layer level.** All heads concatenated (``d_model x d_model``), top-r subspaces for r up to
  d_model.
* **partial correlation.** ``W_K = rho W_Q + sqrt(1 - rho^2) Z`` at the 1.3B head shape: which
  ``rho`` reads seed 000's 0.31.
* **the project's recipes and init regimes.** QKAI per layer at initialisation as ``trainer`` builds
  each recipe (``trainer.model.init``), and the four query/key regimes at each recipe's shape.
* **the 0.70 threshold** expressed at each shape: as a multiple of the random baseline, as the
  fraction of the key subspace inside the query subspace, and in standard deviations of the random
  law.

The computations are in :mod:`experiments.reproduction.qkai_scale_math` and the section of
docs/reproduction.md in :mod:`experiments.reproduction.qkai_scale_section`; this module holds the
settings, runs them (``run``), says the headlines and is the command line.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from experiments.common import at_init_main, at_init_run
from experiments.reproduction.qkai_scale_math import (
    RECIPES,
    REGIMES,
    SEED,
    SEED000_INIT,
    SEED000_SHAPE,
    THRESHOLD,
    correlated,
    layer_level,
    numpy_check,
    numpy_qkai,
    random_law,
    random_sd,
    randomized_vs_exact,
    recipes_at_init,
    threshold_terms,
)

NAME = "qkai_scale"
RESULTS = Path(__file__).resolve().parent / "results" / f"{NAME}.json"

FULL = {
    "d_models": [64, 128, 256, 512, 1024, 2048],
    "d_heads": [16, 32, 64, 128],
    "flop_budget": 4e10,
    "max_heads": 8192,
    "min_heads": 256,
    "layer_d_models": [256, 1024, 2048],
    "layer_draws": 2,
    "rho": [0.0, 0.2, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 1.0],
    "rho_heads": 64,
    "recipe_layers": None,
    "auto_heads": 256,
}
QUICK = {
    "d_models": [64, 256],
    "d_heads": [16, 64],
    "flop_budget": 2e9,
    "max_heads": 2048,
    "min_heads": 128,
    "layer_d_models": [128],
    "layer_draws": 2,
    "rho": [0.0, 0.5, 1.0],
    "rho_heads": 8,
    "recipe_layers": 1,
    "auto_heads": 64,
}

__all__ = [
    "FULL",
    "NAME",
    "QUICK",
    "RECIPES",
    "REGIMES",
    "RESULTS",
    "SEED",
    "SEED000_INIT",
    "SEED000_SHAPE",
    "THRESHOLD",
    "correlated",
    "headlines",
    "layer_level",
    "main",
    "numpy_check",
    "numpy_qkai",
    "random_law",
    "random_sd",
    "randomized_vs_exact",
    "recipes_at_init",
    "run",
    "threshold_terms",
]


# --- run / headlines / main -------------------------------------------------------------------


def run(quick: bool = False) -> dict:
    return at_init_run(NAME, quick, QUICK if quick else FULL, SEED, _parts)


def _parts(results: dict, cfg: dict, gen: torch.Generator) -> None:
    results |= {
        "threshold": THRESHOLD,
        "seed000_init": SEED000_INIT,
        "seed000_shape": SEED000_SHAPE,
        "qkai_method": "exact (float32, the cascade refines ill-conditioned heads in float64)",
    }
    for key, fn in (
        ("random_law", random_law),
        ("numpy_check", lambda c, g: numpy_check(g)),
        ("randomized_vs_exact", randomized_vs_exact),
        ("layer_level", layer_level),
        ("correlated", correlated),
        ("recipes", lambda c, g: recipes_at_init(c)),
    ):
        t0 = time.time()
        results[key] = fn(cfg, gen)
        results.setdefault("wall_s_parts", {})[key] = time.time() - t0
    # the random law's sd at seed 000's shape, measured
    law = [
        r
        for r in results["random_law"]["rows"]
        if r["d_model"] == SEED000_SHAPE["d_model"] and r["d_head"] == r["r"] == SEED000_SHAPE["d_head"]
    ]
    results["seed000"] = threshold_terms(
        SEED000_SHAPE["d_model"], SEED000_SHAPE["d_head"], law[0]["sd"] if law else None
    )


def headlines(results: dict) -> list[str]:
    law = results["random_law"]
    full = [r for r in law["rows"] if r["r"] == r["d_head"]]
    s0 = results["seed000"]
    rec = results["recipes"]
    lines = [
        f"random law: {len(law['rows'])} (d_model, d_head, r) cells, max |measured/(r/d) - 1| = "
        f"{law['max_abs_rel_err']:.3f}, max |z| = {law['max_abs_z']:.2f}",
        f"r = d_head cells: max |rel err| {max(abs(r['rel_err']) for r in full):.4f}",
        f"qkai vs numpy: max abs diff {results['numpy_check']['max_abs_diff']:.1e}",
    ]
    for name in RECIPES:
        r = rec[name]
        lines.append(
            f"{name}: d_model {r['d_model']}, d_head {r['d_head']}: random {r['random_baseline']:.4f}, "
            f"init layers mean {np.mean([x['mean'] for x in r['per_layer']]):.4f}; identical "
            f"{r['regimes']['qk_identical']['mean']:.6f}, disjoint {r['regimes']['disjoint_support_xavier']['mean']:.2e}; "
            f"0.70 = {r['threshold']['threshold_multiple_of_baseline']:.1f}x random"
        )
    lines.append(
        f"seed 000: 0.31 at init = {s0['seed000_init_multiple']:.2f}x the random value {s0['random_baseline']:.4f}; "
        f"random-law r for 0.31 = {s0['seed000_init_equivalent_random_r']:.0f}; rho for 0.31 = "
        f"{results['correlated']['rho_for_0.31']}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    return at_init_main(NAME, __doc__, run, headlines, argv)


if __name__ == "__main__":
    raise SystemExit(main())
