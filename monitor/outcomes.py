"""How a training run went, from its loss alone: ``diverged``, ``spiked`` or ``healthy`` (pure).

This is the yardstick alert rules are scored against (``qkwatch alerts backtest``,
``python -m experiments.instability``). It was written down, with its two numbers, before any
detector was scored, and it is not tuned to flatter one. It reads only the logged training loss:

1. ``L_0`` is the first finite loss; ``m_t`` the running minimum of the finite losses up to step t.
2. The first non-finite loss (NaN, inf) is a **divergence** at its step.
3. A loss that did not train (the mean of the last ``for_steps`` losses is within ``delta`` of
   ``L_0``) **diverged** at its first step: there is nothing a detector could have warned of
   in time, and counting it as healthy would hide it.
4. An *excursion* starts at step s when the loss stays at least ``delta`` above its running
   minimum (``loss >= m_t + delta``) for ``for_steps`` consecutive logged values. No excursion:
   **healthy**.
5. The first excursion's start s is the outcome's step. If the loss never comes back below
   ``m_s + delta`` afterwards, the run **diverged** at s; if it comes back, it **spiked** at s.

Defaults: ``delta`` = 0.5 nats, ``for_steps`` = 5 logged values. On the byte-level recipes a
batch's loss varies by about 0.05 nats from step to step near the end of training, so 0.5 nats
held five times is not noise; and it is a tenth of the loss at initialisation (ln 256 = 5.55).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Label = Literal["diverged", "spiked", "healthy"]


@dataclass(frozen=True)
class OutcomeRule:
    """The two numbers of the rule (see the module docstring)."""

    delta: float = 0.5
    """Nats above the running minimum that count as an excursion, > 0."""
    for_steps: int = 5
    """Consecutive logged losses an excursion must last, >= 1."""

    def __post_init__(self) -> None:
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not self.delta > 0:
            raise ValueError(f"outcome delta must be a number > 0, got {self.delta!r}")
        if isinstance(self.for_steps, bool) or not isinstance(self.for_steps, int) or self.for_steps < 1:
            raise ValueError(f"outcome for must be a whole number >= 1, got {self.for_steps!r}")

    @classmethod
    def parse(cls, text: str) -> OutcomeRule:
        """``"delta=0.5,for=5"`` (either key may be left out); ValueError names what is wrong."""
        fields = {"delta": str(cls.delta), "for": str(cls.for_steps)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, raw = part.partition("=")
            if key not in fields:
                raise ValueError(f"unknown outcome key {key!r} in {text!r} (known: delta, for)")
            fields[key] = raw
        try:
            return cls(delta=float(fields["delta"]), for_steps=int(fields["for"]))
        except ValueError as exc:
            if str(exc).startswith("outcome"):
                raise
            raise ValueError(f"outcome {text!r}: delta must be a number and for a whole number") from None

    def describe(self) -> str:
        return f"delta={self.delta:g},for={self.for_steps}"


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
    tail = statistics.fmean(losses[-rule.for_steps :])
    if tail >= losses[0] - rule.delta:
        return Outcome("diverged", steps[0], f"did not train: last losses {tail:.3f}, first {losses[0]:.3f}")
    start = _first_excursion(losses, rule)
    if start is None:
        return Outcome("healthy", None, f"no loss {rule.delta:g} above its running minimum for {rule.for_steps} steps")
    floor = min(losses[: start + 1])
    recovered = any(x < floor + rule.delta for x in losses[start:])
    kind: Label = "spiked" if recovered else "diverged"
    return Outcome(kind, steps[start], f"loss {losses[start]:.3f} >= minimum {floor:.3f} + {rule.delta:g}")


def _first_excursion(losses: Sequence[float], rule: OutcomeRule) -> int | None:
    """Index where the loss first stays >= running minimum + delta for ``for_steps`` values."""
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
