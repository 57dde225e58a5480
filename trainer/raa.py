"""Rank-Anchored Attention (seed 000): PAR, the Householder key rotation, and the schedule hookup.

Each part is switchable for ablations (``RAAConfig``); with ``enabled=False`` none of this runs:
the model has no rotation, no penalty is computed and no lambdas are read.

* Principal-angle regularisation (PAR). For each flagged layer ``l``

      L_PAR = lambda_l * sum_h ReLU(sum_i c_i^2 - tau)^2,   tau = tau_factor * r,

  with ``c_i`` the cosines of the principal angles between the top-``r`` query and key subspaces
  of head ``h`` (``agent.metrics.principal_overlap``, the one implementation shared with the
  agent), computed on the effective query/key maps (sigma-Reparam's scaled weights; the key
  rotation leaves the key subspace unchanged, see :func:`attention_par`). The penalty is evaluated inside
  ``Attention.forward`` (``Attention.weight_penalties``), where FSDP2 has the layer unsharded, and
  returned with the block's output, so its gradient reaches the shards like any other.
* Householder key rotation: ``trainer.model.KeyRotation`` (``p`` reflections per key head,
  identity at initialisation); the model has one when ``enabled and rotation``.
* Entropy-floor scheduling: ``lambda_l = lambda_0 * sigmoid((H_l - H_star) / beta)`` is computed by
  the collector (or the agent, when the collector is away) from each layer's running entropy and
  read through the monitor's ``lambdas()``; a layer is flagged when ``lambda_l > floor * lambda_0``.
  Without advice (no monitor, or no lambdas yet) the fallback is ``raa.fallback_lambdas``, by
  default ``lambda_0`` on every layer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from agent.metrics import effective_key_map, principal_overlap, split_heads
from trainer.model import effective_weight

logger = logging.getLogger(__name__)

PAR = "par"
"""The name of the PAR term in ``Attention.weight_penalties`` and in the model's penalties."""


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
    schedule: bool = True
    """Read per-layer lambdas from the monitor (entropy-floor schedule); False: always the fallback lambdas."""
    lambda_0: float = 1e-4
    """PAR weight scale (seed 000's lambda_0); also the fallback weight on every layer."""
    lambda_max: float = 1e-2
    """Largest lambda accepted from the monitor (the collector validates overrides against it)."""
    fallback_lambdas: list[float] | None = None
    """Per-layer lambdas when the monitor gives none, or when schedule is off (None: lambda_0 on every layer)."""
    floor: float = 0.01
    """A layer is flagged (PAR computed) when its lambda exceeds floor * lambda_0."""
    tau_factor: float = 0.45
    """tau = tau_factor * r (seed 000: 0.45)."""
    rank: int | None = None
    """r, the subspace rank of the overlap; None = d_head."""
    method: str = "auto"
    """principal_overlap method: exact, randomized (svd_lowrank) or auto."""
    every: int = 1
    """Compute PAR every k steps on flagged layers, weighted by k (k > 1 trades accuracy for time)."""
    h_star: float = 0.85
    """Entropy target H* of the schedule (normalised attention entropy)."""
    beta: float = 0.05
    """Temperature of the schedule's sigmoid."""
    ema: float = 0.9
    """Smoothing of the running per-layer entropy the schedule reads."""

    def __post_init__(self) -> None:
        if self.reflections < 2 or self.reflections % 2:
            raise ValueError(f"raa.reflections={self.reflections} must be an even number >= 2")
        for key in ("lambda_0", "lambda_max", "floor", "beta"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"raa.{key} must be a finite number >= 0, got {value!r}")
        if self.beta == 0:
            raise ValueError("raa.beta must be > 0")
        if self.lambda_max < self.lambda_0:
            raise ValueError(f"raa.lambda_max={self.lambda_max} is below raa.lambda_0={self.lambda_0}")
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
        if not 0 <= self.ema < 1:
            raise ValueError(f"raa.ema must lie in [0, 1), got {self.ema}")

    @property
    def uses_par(self) -> bool:
        return self.enabled and self.par

    @property
    def uses_rotation(self) -> bool:
        return self.enabled and self.rotation

    def schedule_config(self) -> dict[str, float]:
        """The collector's entropy-floor schedule parameters (sent with the run's config)."""
        return {"lambda_0": self.lambda_0, "h_star": self.h_star, "beta": self.beta, "ema": self.ema,
                "lambda_max": self.lambda_max}


def par_penalty(wq: Tensor, wk: Tensor, rotation: Tensor | None, *, n_heads: int, n_kv_heads: int,
                rank: int | None, tau_factor: float, method: str = "auto") -> Tensor:
    """``sum_h ReLU(sum_i c_i^2 - tau)^2`` of one layer, differentiable in ``wq``, ``wk`` and the rotation.

    Args:
        wq: ``(n_heads * d_head, d_model)``, ``nn.Linear`` layout.
        wk: ``(n_kv_heads * d_head, d_model)``.
        rotation: ``(n_kv_heads, d_head, d_head)`` key rotation or None.
        rank: ``r`` (None: ``d_head``); ``tau = tau_factor * r``.

    Returns:
        A scalar ``>= 0``. A head whose overlap is undefined (a rank-deficient, dead head) adds 0:
        PAR cannot act on a subspace that does not exist.
    """
    q = split_heads(wq, n_heads)  # (nh, D, hs)
    k = effective_key_map(split_heads(wk, n_kv_heads), rotation)  # (nkv, D, hs)
    r = q.shape[-1] if rank is None else min(rank, q.shape[-1])
    # refine=False: inside the forward a loss needs no 1e-5 accuracy, and skipping the float64
    # recomputation of ill-conditioned heads means no host synchronisation and no graph break
    overlap = principal_overlap(q, k, r, method=method, refine=False)  # (nh,)
    overlap = overlap.to(torch.promote_types(wq.dtype, torch.float32))
    excess = F.relu(torch.nan_to_num(overlap, nan=0.0) - tau_factor * r)
    return excess.square().sum()


def attention_par(attn, *, rank: int | None, tau_factor: float, method: str) -> Tensor:
    """PAR of one attention module from its effective weights (what ``Attention.weight_penalties`` calls).

    The key rotation is left out on purpose: ``Wk R^T`` spans the same subspace as ``Wk`` for an
    orthogonal ``R`` (its left singular vectors are ``Wk``'s), so the principal angles, the penalty
    and its gradient are the same with or without it, and building ``R`` would only cost time.
    ``tests/trainer/test_trainer_raa.py`` holds the invariance.
    """
    return par_penalty(effective_weight(attn.q_proj), effective_weight(attn.k_proj), None, n_heads=attn.n_heads,
                       n_kv_heads=attn.n_kv_heads, rank=rank, tau_factor=tau_factor, method=method)


class RAAController:
    """Per-run RAA state: reads lambdas, flags layers, and turns penalties into the loss term."""

    def __init__(self, config: RAAConfig, attentions: list) -> None:
        self.config = config
        self.attentions = attentions
        self.n_layers = len(attentions)
        self._flags = [False] * self.n_layers
        self._warned = False

    def lambdas(self, monitor) -> list[float]:
        """This step's per-layer lambdas: the monitor's advice when valid, else ``lambda_0`` everywhere."""
        c = self.config
        fallback = [c.lambda_0] * self.n_layers if c.fallback_lambdas is None else list(c.fallback_lambdas)
        if not c.uses_par:
            return [0.0] * self.n_layers
        if not c.schedule:
            return fallback
        advice = monitor.lambdas()
        if advice is None:
            return fallback
        advice = [float(v) for v in advice]
        if len(advice) != self.n_layers or not all(math.isfinite(v) and 0 <= v <= c.lambda_max for v in advice):
            if not self._warned:
                logger.warning("ignoring lambdas %s from the monitor: need %d finite values in [0, %g]",
                               advice[:8], self.n_layers, c.lambda_max)
                self._warned = True
            return fallback
        return advice

    def apply(self, lambdas: list[float], step: int) -> list[bool]:
        """Install PAR on the flagged layers for this step; returns the flags."""
        c = self.config
        due = c.uses_par and step % c.every == 0
        flags = [due and lam > c.floor * c.lambda_0 for lam in lambdas]
        for attn, flag, was in zip(self.attentions, flags, self._flags, strict=True):
            if flag and not was:
                attn.weight_penalties[PAR] = partial(attention_par, rank=c.rank, tau_factor=c.tau_factor,
                                                     method=c.method)
            elif was and not flag:
                attn.weight_penalties.pop(PAR, None)
        self._flags = flags
        return flags

    def loss(self, penalties: list[dict[str, Tensor]], lambdas: list[float]) -> tuple[Tensor | None, list]:
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
