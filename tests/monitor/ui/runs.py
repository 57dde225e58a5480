"""Synthetic runs for the page and report tests: two of project ``demo``, where ``vanilla`` grows a QKAI
band above 0.70 at layers 3-5 (so the collector's ``collapse_band`` alert fires) and ``raa`` does not;
a run that has reported only its first steps; and a sweep of many runs."""

from __future__ import annotations

import math
from collections.abc import Iterable

from qkwatch.client.rest import Client

N_LAYERS = 8
BAND = (3, 4, 5)
STEPS = range(0, 301, 5)
VAL_EVERY = 50


def qkai(step: int, layer: int, peak: float) -> float:
    """A smooth synthetic QKAI: layers of ``BAND`` rise towards ``peak`` around step 150, the rest stay low."""
    base = 0.25 + 0.025 * layer + 0.015 * math.sin(0.37 * step + layer)
    if layer not in BAND:
        return base
    top = peak - (0.08 if layer != 4 else 0.0)
    return base + (top - base) / (1 + math.exp(-(step - 150) / 20))


def loss(step: int, floor: float) -> float:
    return floor + 4.0 * math.exp(-step / 60)


def reports(steps: Iterable[int], peak: float, floor: float) -> list[dict]:
    """One report per step: QKAI and entropy per layer, the train loss, and the validation loss every 50 steps."""
    out = []
    for s in steps:
        scalars = {"loss": loss(s, floor)}
        if s % VAL_EVERY == 0 and s:
            scalars["val_loss"] = loss(s, floor) + 0.2
        out.append(
            {
                "step": s,
                "time": float(s),
                "scalars": scalars,
                "layers": {
                    "qkai": [qkai(s, i, peak) for i in range(N_LAYERS)],
                    "attn_entropy": [1 - 0.8 * qkai(s, i, peak) for i in range(N_LAYERS)],
                },
            }
        )
    return out


RUNS = (("vanilla", 0.86, 1.30), ("raa", 0.66, 1.35))  # name, band QKAI peak, loss floor


def seed(client: Client, steps: Iterable[int] = STEPS) -> tuple[dict, dict]:
    """The two runs, created and reported to ``client``'s collector: (vanilla, raa)."""
    steps = list(steps)
    runs = []
    for name, peak, floor in RUNS:
        run = client.create_run("demo", name, {"n_layers": N_LAYERS})
        client.send_reports(run["id"], reports(steps, peak, floor))
        runs.append(run)
    return runs[0], runs[1]


def first_steps(client: Client, name: str, steps: Iterable[int]) -> dict:
    """A run of project ``demo`` that has reported only ``steps`` (say just step 0), with the vanilla run's values."""
    run = client.create_run("demo", name, {"n_layers": N_LAYERS})
    client.send_reports(run["id"], reports(steps, peak=0.86, floor=1.30))
    return run


def sweep(client: Client, n: int) -> list[dict]:
    """``n`` runs of a learning-rate sweep over three projects, each with two reports (steps 0 and 5), the
    last created first in the collector's list."""
    runs = []
    for i in range(n):
        run = client.create_run(f"sweep{i % 3}", f"lr-{i:02d}-warmup-{100 * i}", {"n_layers": N_LAYERS})
        client.send_reports(run["id"], reports([0, 5 * (1 + i % 4)], peak=0.5, floor=1.30))
        runs.append(run)
    return runs
