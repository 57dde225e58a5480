"""Rank-Anchored Attention (seed 000): PAR, the Householder key rotation, and the schedule hookup.

Each part is switchable for ablations (``RAAConfig``); with ``enabled=False`` none of this runs:
the model has no rotation, no penalty is computed and no lambdas are read.

* Principal-angle regularisation (PAR). For each flagged layer ``l``

      L_PAR = lambda_l * sum_h ReLU(sum_i c_i^2 - tau)^2,   tau = tau_factor * r,

  with ``c_i`` the cosines of the principal angles between the top-``r`` query and key subspaces
  of head ``h``: ``agent.metrics.par_penalty`` with ``tau_factor`` defaulting to its
  ``TAU_FACTOR``, the one definition, shared with ``qkwatch.raa``. It is computed on the effective
  query/key maps (sigma-Reparam's scaled weights; the key rotation leaves the key subspace
  unchanged, see :func:`attention_par`). The penalty is evaluated inside
  ``Attention.forward`` (``Attention.weight_penalties``), where FSDP2 has the layer unsharded, and
  returned with the block's output, so its gradient reaches the shards like any other.
* Householder key rotation: ``trainer.model.key_rotation.KeyRotation`` (``p`` reflections per key head,
  identity at initialisation); the model has one when ``enabled and rotation``.
* Entropy-floor scheduling: ``lambda_l = lambda_0 * sigmoid((H_l - H_star) / beta)`` is computed by
  the collector from each layer's running entropy, or, with no collector or an unreachable one, by
  the agent from its own measured entropies with the same code (``contract.scheduling``) and the
  same parameters (``raa.schedule``); it is read through the monitor's ``lambdas()``. A layer is
  flagged (PAR computed) when ``lambda_l > floor * lambda_0``. With scheduling off the weights are
  ``raa.fallback_lambdas``, by default ``lambda_0`` on every layer (seed 000's ablation).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from torch import Tensor

from qkwatch.agent.metrics import TAU_FACTOR, par_penalty, split_heads
from qkwatch.trainer.model.gpt import Attention
from qkwatch.trainer.model.normalisation import effective_weight
from qkwatch.trainer.reporting.monitoring import Monitor, ScheduleConfig

logger = logging.getLogger(__name__)

PAR = "par"
"""The name of the PAR term in ``Attention.weight_penalties`` and in the model's penalties."""
OverlapMethod = Literal["auto", "exact", "randomized"]
"""``principal_overlap``'s methods."""


@dataclass
class RAAConfig:
    """Rank-Anchored Attention and its ablation switches."""

    enabled: bool = False
    """Master switch. False: no rotation, no penalty, no lambdas read (no cost at all)."""
    par: bool = True
    """Principal-angle regularisation."""
    rotation: bool = True
    """Householder key rotation."""
    reflections: int = 4
    """p, the Householder reflections per key head (even: they start as equal pairs)."""
    scheduling: bool = True
    """Entropy-floor scheduling: per-layer lambdas from the collector, or from the same schedule
    computed by the agent from its own measured entropies when there is no collector (or it is
    away). False: ``fallback_lambdas`` on every step (seed 000's "no scheduling" ablation)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The schedule's parameters (``lambda_0``, ``h_star``, ``beta``, ``ema``, ``lambda_max``,
    ``floor``); the collector and the agent read the same ones from the run's config. The
    defaults and the reasoning behind them are in ``contract.scheduling.ScheduleConfig``."""
    fallback_lambdas: list[float] | None = None
    """Per-layer lambdas when scheduling is off, or when the monitor gives none (None: lambda_0 on every layer)."""
    tau_factor: float = TAU_FACTOR
    """tau = tau_factor * r (seed 000: 0.45, ``agent.metrics.TAU_FACTOR``)."""
    rank: int | None = None
    """r, the subspace rank of the overlap; None = d_head."""
    method: OverlapMethod = "auto"
    """principal_overlap method: exact, randomized (svd_lowrank) or auto."""
    every: int = 1
    """Compute PAR every k steps on flagged layers, weighted by k (k > 1 trades accuracy for time)."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, dict):  # from a config file or a run's JSON
            self.schedule = ScheduleConfig.from_mapping(self.schedule)
        if self.reflections < 2 or self.reflections % 2:
            raise ValueError(f"raa.reflections={self.reflections} must be an even number >= 2")
        if not 0 < self.tau_factor < 1:
            raise ValueError(f"raa.tau_factor must lie in (0, 1), got {self.tau_factor}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"raa.rank must be >= 1 or None, got {self.rank}")
        if self.method not in ("auto", "exact", "randomized"):
            raise ValueError(f"raa.method={self.method!r} is not one of auto, exact, randomized")
        if self.every < 1:
            raise ValueError(f"raa.every must be >= 1, got {self.every}")
        if self.fallback_lambdas is not None and not all(math.isfinite(v) and v >= 0 for v in self.fallback_lambdas):
            raise ValueError(f"raa.fallback_lambdas must be finite and >= 0, got {self.fallback_lambdas}")

    @property
    def uses_par(self) -> bool:
        return self.enabled and self.par

    @property
    def uses_rotation(self) -> bool:
        return self.enabled and self.rotation

    @property
    def uses_schedule(self) -> bool:
        """PAR weighted by the entropy-floor schedule (so the agent must measure entropies)."""
        return self.uses_par and self.scheduling


def attention_par(attn: Attention, *, rank: int | None, tau_factor: float, method: OverlapMethod) -> Tensor:
    """PAR of one attention module from its effective weights (what ``Attention.weight_penalties`` calls).

    The key rotation is left out on purpose: ``Wk R^T`` spans the same subspace as ``Wk`` for an
    orthogonal ``R`` (its left singular vectors are ``Wk``'s), so the principal angles, the penalty
    and its gradient are the same with or without it, and building ``R`` would only cost time.
    ``tests/trainer/test_trainer_raa.py`` holds the invariance.
    """
    return par_penalty(
        split_heads(effective_weight(attn.q_proj), attn.n_heads),  # (nh, D, hs)
        split_heads(effective_weight(attn.k_proj), attn.n_kv_heads),  # (nkv, D, hs)
        rank,
        tau_factor=tau_factor,
        method=method,
    )


class RAAController:
    """Per-run RAA state: reads lambdas, flags layers, and turns penalties into the loss term."""

    def __init__(self, config: RAAConfig, attentions: list[Attention]) -> None:
        self.config = config
        self.attentions = attentions
        self.n_layers = len(attentions)
        self._flags = [False] * self.n_layers
        self._warned = False

    def lambdas(self, monitor: Monitor) -> list[float]:
        """This step's per-layer lambdas: the schedule's (through the monitor), else the fallback.

        With scheduling on, the monitor (the agent) serves the collector's lambdas or, without a
        collector, the same schedule computed from its own entropies: it has already validated them
        value by value. A monitor that gives none (``NullMonitor``) leaves the fallback, loudly.
        """
        c = self.config
        if not c.uses_par:
            return [0.0] * self.n_layers
        fallback = self._fallback()
        if not c.scheduling:
            return fallback
        advice = monitor.lambdas()
        if advice is None or len(advice) != self.n_layers:
            if not self._warned:
                logger.warning(
                    "raa: the monitor gives %s lambdas for %d layers; applying raa.fallback_lambdas "
                    "(lambda_0 on every layer unless set): seed 000's no-scheduling ablation, not RAA",
                    "no" if advice is None else len(advice),
                    self.n_layers,
                )
                self._warned = True
            return fallback
        return [min(max(float(v), 0.0), c.schedule.lambda_max) if math.isfinite(v) else 0.0 for v in advice]

    def _fallback(self) -> list[float]:
        c = self.config
        return [c.schedule.lambda_0] * self.n_layers if c.fallback_lambdas is None else list(c.fallback_lambdas)

    def apply(self, lambdas: list[float], step: int) -> list[bool]:
        """Install PAR on the flagged layers for this step; returns the flags."""
        c = self.config
        due = c.uses_par and step % c.every == 0
        flags = [due and flag for flag in c.schedule.flagged(lambdas)]
        for attn, flag, was in zip(self.attentions, flags, self._flags, strict=True):
            if flag and not was:
                attn.weight_penalties[PAR] = partial(
                    attention_par, rank=c.rank, tau_factor=c.tau_factor, method=c.method
                )
            elif was and not flag:
                attn.weight_penalties.pop(PAR, None)
        self._flags = flags
        return flags

    def loss(
        self, penalties: list[dict[str, Tensor]], lambdas: list[float]
    ) -> tuple[Tensor | None, list[Tensor | float]]:
        """``sum_l k * lambda_l * P_l`` over the layers that computed PAR, and each layer's term.

        ``k = every`` keeps the expected weight when PAR runs every k-th step. The per-layer terms are
        tensors where computed and 0.0 elsewhere (the layer added nothing to the loss).
        """
        scale = float(self.config.every)
        terms: list[Tensor | float] = []
        total = None
        for pen, lam in zip(penalties, lambdas, strict=True):
            if PAR in pen:
                term = pen[PAR] * (scale * lam)
                total = term if total is None else total + term
                terms.append(term)
            else:
                terms.append(0.0)
        return total, terms
