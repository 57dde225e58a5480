"""How a training run went, from its loss alone: ``diverged``, ``spiked`` or ``healthy`` (pure).

This is the yardstick alert rules are scored against (``qkwatch alerts backtest``,
``python -m experiments.instability``). It is not tuned to flatter a detector. It reads only the
logged training loss:

1. ``L_0`` is the first logged loss. The first non-finite loss (NaN, inf) is a **divergence** at
   its step.
2. The loss is smoothed by a trailing mean over the last ``window`` logged values (fewer at the
   start), ``s_t``; ``m_t`` is the running minimum of ``s`` up to step t.
3. A run that did not train (its final smoothed loss is within ``delta`` of ``L_0``) **diverged**
   at its first step: nothing could have warned of it in time, and calling it healthy would hide it.
4. An *excursion* starts at step t when ``s`` stays at least ``delta`` above its running minimum
   (``s >= m + delta``) for ``for_steps`` consecutive logged values. None: **healthy**.
5. The first excursion's start is the outcome's step. If ``s`` never comes back below
   ``m + delta`` afterwards, the run **diverged** there; if it comes back, it **spiked** there.

Defaults: ``delta`` = 0.5 nats, ``for_steps`` = 5 and ``window`` = 20 logged values. On the
suite's byte-level data a single batch's loss varies by about 0.2 nats from step to step late in
a healthy run (measured: 0.19-0.21, the step-to-step difference over sqrt 2, steps 150-300 of the
``instability_cpu`` runs at lr 1e-3, both seeds), with rare easy batches 0.6 below the rest. A
mean of 20 cuts that to about 0.045, so a 0.5-nat rise of the smoothed loss held five steps is
about eleven of its standard deviations: trouble, not a batch. 0.5 nats is a tenth of the loss at
initialisation (ln 256 = 5.55).

Revision (v2). The first version (v1, commit 924f0e1) had no smoothing and assumed a per-step
noise of 0.05 nats. Measured on the suite's first 20 runs it is about four times that, and v1
labelled 11 of them "spiked" between steps 171 and 265 from batch noise alone (e.g. lr 1e-3,
seed 0: a running minimum of 1.35 from one easy batch, then ordinary batches at 2.0); v2 labels
those 11 healthy and keeps the 3 spikes in the first 6 steps of the lr 0.1 and 0.3 runs. The rule
was revised to v2 before any detector was scored on the suite (no backtest of it had run), and it
is not moved after.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Label = Literal["diverged", "spiked", "healthy"]


@dataclass(frozen=True)
class OutcomeRule:
    """The three numbers of the rule (see the module docstring)."""

    delta: float = 0.5
    """Nats above the running minimum of the smoothed loss that count as an excursion, > 0."""
    for_steps: int = 5
    """Consecutive logged losses an excursion must last, >= 1."""
    window: int = 20
    """Logged losses in the trailing mean that smooths the loss, >= 1 (1: no smoothing)."""

    def __post_init__(self) -> None:
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not self.delta > 0:
            raise ValueError(f"outcome delta must be a number > 0, got {self.delta!r}")
        if isinstance(self.for_steps, bool) or not isinstance(self.for_steps, int) or self.for_steps < 1:
            raise ValueError(f"outcome for must be a whole number >= 1, got {self.for_steps!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"outcome window must be a whole number >= 1, got {self.window!r}")

    @classmethod
    def parse(cls, text: str) -> OutcomeRule:
        """``"delta=0.5,for=5,window=20"`` (any key may be left out); ValueError names what is wrong."""
        fields = {"delta": str(cls.delta), "for": str(cls.for_steps), "window": str(cls.window)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, raw = part.partition("=")
            if key not in fields:
                raise ValueError(f"unknown outcome key {key!r} in {text!r} (known: delta, for, window)")
            fields[key] = raw
        try:
            return cls(delta=float(fields["delta"]), for_steps=int(fields["for"]), window=int(fields["window"]))
        except ValueError as exc:
            if str(exc).startswith("outcome"):
                raise
            raise ValueError(f"outcome {text!r}: delta must be a number, for and window whole numbers") from None

    def describe(self) -> str:
        return f"delta={self.delta:g},for={self.for_steps},window={self.window}"


@dataclass(frozen=True)
class Outcome:
    """A run's label and the step it happened at (None for a healthy run)."""

    label: Label
    step: int | None
    why: str


def label(steps: Sequence[int], losses: Sequence[float], rule: OutcomeRule | None = None) -> Outcome:
    """Label a run from its logged training losses (``steps`` ascending, one loss each).

    Raises:
        ValueError: if the two sequences differ in length, or there is no loss at all.
    """
    rule = rule or OutcomeRule()
    if len(steps) != len(losses):
        raise ValueError(f"{len(steps)} steps but {len(losses)} losses")
    if not losses:
        raise ValueError("no loss was logged: the outcome needs the training loss")
    for step, loss in zip(steps, losses, strict=True):
        if not math.isfinite(loss):
            return Outcome("diverged", step, f"loss {loss} at step {step}")
    smooth = smoothed(losses, rule.window)
    if smooth[-1] >= losses[0] - rule.delta:
        return Outcome("diverged", steps[0], f"did not train: smoothed loss {smooth[-1]:.3f}, first {losses[0]:.3f}")
    start = _first_excursion(smooth, rule)
    if start is None:
        return Outcome(
            "healthy", None, f"smoothed loss never {rule.delta:g} above its running minimum for {rule.for_steps} steps"
        )
    floor = min(smooth[: start + 1])
    recovered = any(x < floor + rule.delta for x in smooth[start:])
    kind: Label = "spiked" if recovered else "diverged"
    return Outcome(kind, steps[start], f"smoothed loss {smooth[start]:.3f} >= minimum {floor:.3f} + {rule.delta:g}")


def smoothed(losses: Sequence[float], window: int) -> list[float]:
    """The trailing mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def _first_excursion(losses: Sequence[float], rule: OutcomeRule) -> int | None:
    """Index where the (smoothed) loss first stays >= its running minimum + delta for ``for_steps`` values."""
    low, run_start, run = math.inf, 0, 0
    for i, x in enumerate(losses):
        low = min(low, x)
        if x >= low + rule.delta:
            run_start, run = (i, 1) if run == 0 else (run_start, run + 1)
            if run >= rule.for_steps:
                return run_start
        else:
            run = 0
    return None
