"""The synthetic values of the fleet's reports, functions of (run, layer, step) so that a replay sends the
same numbers; every other run collapses, and :func:`expected_alerts` says what the default rules must raise.
"""

from __future__ import annotations

import math

from bench.fleet.config import (
    ACTIVATION_METRICS,
    BAND,
    HOT_LAYERS,
    SPECTRA_METRICS,
    THRESHOLD,
)


def noise(*key: float) -> float:
    """A deterministic pseudo-random number in [0, 1) of ``key``."""
    x = math.sin(sum((i + 1) * 12.9898 * k for i, k in enumerate(key)) + 78.233) * 43758.5453
    return x - math.floor(x)


def hot(run_index: int) -> bool:
    """Every other run collapses."""
    return run_index % 2 == 0


def crossing(layer: int) -> float:
    """The fraction of the run at which a hot layer's QKAI crosses the threshold (band layers one after another)."""
    return 0.30 + 0.03 * (layer - BAND[0]) if layer in BAND else 0.40


def qkai(run_index: int, layer: int, step: int, steps: int) -> float:
    """Monotone through 0.70 at :func:`crossing` on a hot layer of a collapsing run; 0.25-0.45 elsewhere."""
    if hot(run_index) and layer in HOT_LAYERS:
        t = step / steps
        return min(0.92, max(0.45, THRESHOLD + 0.8 * (t - crossing(layer))))
    return 0.25 + 0.2 * noise(run_index, layer, step, 1)


def attn_entropy(run_index: int, layer: int, step: int, steps: int) -> float:
    """Drifts toward uniform (0.95) with QKAI on a hot layer; 0.70-0.78 elsewhere (lambdas stay low)."""
    base = 0.70 + 0.08 * noise(run_index, layer, step, 2)
    if hot(run_index) and layer in HOT_LAYERS:
        ramp = min(1.0, max(0.0, (step / steps - crossing(layer) + 0.2) / 0.3))
        return base + (0.95 - base) * ramp
    return base


def layer_values(run_index: int, layer: int, step: int, steps: int, spectra: bool) -> dict[str, float]:
    """One layer's metrics of one report."""
    q = qkai(run_index, layer, step, steps)
    out = {
        "qkai": q,
        "qkai_max": min(1.0, q + 0.05),
        "stable_rank": 8.0 + 4.0 * noise(run_index, layer, step, 3),
        "qk_cos": 0.1 + 0.1 * noise(run_index, layer, step, 4),
        "attn_entropy": attn_entropy(run_index, layer, step, steps),
    }
    for i, name in enumerate(ACTIVATION_METRICS):
        out.setdefault(name, 0.5 + noise(run_index, layer, step, 10 + i))
    if spectra:
        for i, name in enumerate(SPECTRA_METRICS):
            out[name] = 10.0 + noise(run_index, layer, step, 30 + i)
    return out


def loss(run_index: int, step: int) -> float:
    return 3.0 / (1.0 + step / 500) + 0.05 * noise(run_index, step, 5)


def expected_alerts(runs: list[str]) -> set[tuple[str, str, tuple[int, ...]]]:
    """(run, rule, layers) of every alert the default rules must raise, once each."""
    out: set[tuple[str, str, tuple[int, ...]]] = set()
    for i, name in enumerate(runs):
        if hot(i):
            out |= {(name, "qkai_high", (layer,)) for layer in HOT_LAYERS}
            out.add((name, "collapse_band", BAND))
    return out
