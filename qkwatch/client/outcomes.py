"""How a training run went: ``diverged``, ``spiked``, ``degraded`` or ``healthy`` (pure).

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

Where a run ends (v3, issue 31). Spikes and divergence say nothing of a run that trains to a worse
place than it could have: a learning rate that is too high can end a nat worse without a single
excursion. :class:`Degradation` judges the end: a run is **degraded** when its final held-out loss
(the mean of its last ``k`` evaluations) is at least ``delta`` above its reference's, the reference
being the same variant and seed at the sweep's best rate. ``delta`` is not picked by eye: it is
:func:`choose_delta` of the measured seed-to-seed spread of that final loss, fixed and written down
before any detector is scored. :func:`judge` combines the two: diverged, then degraded, then
spiked, then healthy (a spike the run recovered from and ended fine after is ``spiked``; one it
ended worse after is ``degraded``).

What the loss alone shows a user (W&B, MLflow) is :class:`LossAlert`, a loss-only alert with its
parameters written down, and :func:`loss_visible_step`, the first step it fires: the yardstick of
a detector's lead (an alert before it is early; after it, qkwatch was later than the loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Label = Literal["diverged", "spiked", "degraded", "healthy"]


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


# --- where a run ends (v3) ------------------------------------------------------------------------

SUITE_DELTA = 0.11
"""The instability suite's fixed delta (nats): 3 sqrt(2) x 0.0238, the pooled seed-to-seed standard deviation
of the tune recipe's final held-out loss at each variant's best rate, rounded up
(``experiments/results/instability_sweep_outcome.json``). ``qkwatch alerts backtest --reference`` uses it
unless told otherwise: a recipe with another spread should measure its own (:func:`choose_delta`)."""

SPREAD_MULTIPLE = 3.0
"""``delta`` is this many standard deviations of the difference of two runs of one configuration."""


@dataclass(frozen=True)
class Degradation:
    """A run is degraded when its final held-out loss is at least ``delta`` above its reference's."""

    delta: float
    """Nats, > 0: :func:`choose_delta` of the measured spread, written down before any scoring."""
    k: int = 3
    """Held-out evaluations averaged at the end of a run (the final held-out loss)."""
    spread: float | None = None
    """The pooled seed-to-seed standard deviation ``delta`` was chosen from, kept beside it."""
    reference: str = "the same variant and seed at the variant's best rate"

    def __post_init__(self) -> None:
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not self.delta > 0:
            raise ValueError(f"degradation delta must be a number > 0, got {self.delta!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"degradation k must be a whole number >= 1, got {self.k!r}")

    def describe(self) -> str:
        spread = "" if self.spread is None else f" (seed-to-seed sd {self.spread:.4f})"
        last = f"final held-out loss (mean of the last {self.k})"
        return f"{last} >= reference + {self.delta:g}{spread}; reference: {self.reference}"


def final_heldout(values: Sequence[float], k: int) -> float:
    """The mean of the last ``k`` held-out losses; inf when there is none or one is not finite."""
    tail = list(values)[-k:]
    if not tail or not all(math.isfinite(v) for v in tail):
        return math.inf
    return math.fsum(tail) / len(tail)


def choose_delta(finals: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(delta, spread)`` from groups of final held-out losses of one configuration each (the seeds of
    a variant at its best rate).

    ``spread`` is the pooled standard deviation (each group's sum of squares about its own mean,
    over the sum of their degrees of freedom); ``delta = SPREAD_MULTIPLE x sqrt(2) x spread``, rounded
    up to 0.01 nats. A run and its reference differ by noise with standard deviation ``sqrt(2)``
    spread, so under a normal spread noise alone crosses ``delta`` once in about 740 runs (3 sigma,
    one-sided).

    Raises:
        ValueError: no group with two finite values (no spread can be measured).
    """
    groups = [[v for v in g if math.isfinite(v)] for g in finals]
    groups = [g for g in groups if len(g) >= 2]
    if not groups:
        raise ValueError("choose_delta needs at least one configuration with two finite final losses")
    squares = math.fsum((v - math.fsum(g) / len(g)) ** 2 for g in groups for v in g)
    spread = math.sqrt(squares / sum(len(g) - 1 for g in groups))
    return math.ceil(SPREAD_MULTIPLE * math.sqrt(2) * spread * 100 - 1e-9) / 100, spread


@dataclass(frozen=True)
class LossAlert:
    """A loss-only alert (v1, issue 31): what a user who watches only the training loss is told.

    It fires at the first logged step where the loss is not finite, or where the loss smoothed over
    ``window`` values (a) has risen ``rise`` above its running minimum for ``for_steps`` values (the
    excursion of :class:`OutcomeRule`), or (b) has stalled: from step ``start`` on, and until
    ``until`` of the run's steps (after that a cosine decay flattens every healthy run), it fell by
    less than ``drop`` nats over the last ``span`` logged values. The defaults were written down
    before the sweep was scored: the smoothing and the rise are :class:`OutcomeRule`'s; a healthy
    ``instability_small`` run falls by more than 0.07 nats of held-out loss per 100 steps until step
    700 (lr 3e-3, probed before the sweep), so 0.02 is stalled.
    """

    window: int = 20
    rise: float = 0.5
    for_steps: int = 5
    span: int = 100
    drop: float = 0.02
    start: int = 100
    until: float = 0.75

    def describe(self) -> str:
        return (
            f"loss not finite; or smoothed (window {self.window}) {self.rise:g} above its minimum for "
            f"{self.for_steps} steps; or, from step {self.start} to {self.until:g} of the run, less than "
            f"{self.drop:g} lower than {self.span} steps before"
        )


def loss_visible_step(
    steps: Sequence[int], losses: Sequence[float], total_steps: int, alert: LossAlert | None = None
) -> int | None:
    """The first logged step at which :class:`LossAlert` fires; None when it never does."""
    alert = alert or LossAlert()
    if len(steps) != len(losses):
        raise ValueError(f"{len(steps)} steps but {len(losses)} losses")
    for step, loss in zip(steps, losses, strict=True):
        if not math.isfinite(loss):
            return step
    smooth = smoothed(losses, alert.window)
    rise = _first_excursion(smooth, OutcomeRule(delta=alert.rise, for_steps=alert.for_steps, window=alert.window))
    stall = next(
        (
            i
            for i in range(alert.span, len(smooth))
            if alert.start <= steps[i] <= alert.until * total_steps and smooth[i - alert.span] - smooth[i] < alert.drop
        ),
        None,
    )
    found = [i for i in (rise, stall) if i is not None]
    return steps[min(found)] if found else None


def judge(
    steps: Sequence[int],
    losses: Sequence[float],
    final: float,
    reference: float | None,
    degradation: Degradation,
    rule: OutcomeRule | None = None,
    *,
    visible: int | None = None,
) -> Outcome:
    """A run's outcome from its loss and where it ended: diverged, then degraded, then spiked, then healthy.

    ``final`` is the run's final held-out loss (:func:`final_heldout`), ``reference`` its reference's
    (None: the run is its own reference, or has none). A degraded run's step is ``visible`` (the step
    the loss alone showed trouble, :func:`loss_visible_step`), else its last step: with the loss
    alone, a user learns of it at the end.
    """
    spikes = label(steps, losses, rule)
    if spikes.label == "diverged":
        return spikes
    if reference is not None and final >= reference + degradation.delta:
        why = f"final held-out loss {final:.3f} >= reference {reference:.3f} + {degradation.delta:g}"
        return Outcome("degraded", visible if visible is not None else steps[-1], why)
    return spikes
