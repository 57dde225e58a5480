"""Rank-Anchored Attention's PAR term for any training loop (seed 000), with the collector's lambdas.

The project's trainer adds PAR inside its own attention (``qkwatch.trainer.model.rank_anchored``);
any other loop adds it to its loss here::

    agent = qkwatch.attach(model, ...)
    par = ParLoss(model)                       # finds the layers once, as the agent does
    for step in range(steps):
        agent.step(step)
        lambdas = agent.lambdas()              # every rank, every step (or never)
        loss = model(batch).loss + par(lambdas)
        loss.backward()
        ...

For one layer ``l`` with ``lambda_l > 0``

    L_PAR_l = lambda_l * sum_h ReLU(sum_i c_i^2 - tau)^2,   tau = tau_factor * r,

``c_i`` the cosines of the principal angles between the top-``r`` query and key subspaces of head
``h`` (``r = d_head`` by default). The formula and ``tau_factor``'s default are the trainer's:
``qkwatch.agent.metrics.par_penalty`` and ``TAU_FACTOR``. With grouped-query attention key head
``g`` serves query heads ``g n_rep ... (g + 1) n_rep - 1``, each a term of the sum. The layers and
their projections are the agent's (``qkwatch.agent.find_sites``): qkwatch's GPT, HF
Llama/Mistral/Qwen/BERT/GPT-2, nanoGPT, or an explicit ``layout``. The weights are views of the
model's parameters, so the term is differentiable in ``W_Q`` and ``W_K`` and its gradient reaches
them through ``backward``.

A key rotation (RAA's Householder ``R``) is left out: ``W_K R^T`` spans ``W_K``'s column space, so
the angles are the same. Parameters sharded by FSDP2 (DTensors) exist whole only inside the
layer's forward: compute PAR there, as the project's trainer does; this module is for plain, DDP
and single-device models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from qkwatch.agent import Layout, Site, find_sites
from qkwatch.agent.metrics import TAU_FACTOR, par_penalty


class ParLoss:
    """``sum_l lambda_l * PAR_l`` of one model; build it once, call it every step with that step's lambdas."""

    def __init__(
        self, model: nn.Module, *, tau_factor: float = TAU_FACTOR, rank: int | None = None, layout: Layout | None = None
    ) -> None:
        """Find the model's attention layers (as ``qkwatch.attach`` does).

        Args:
            model: the model the agent watches: the unwrapped one (``accelerator.unwrap_model``,
                ``ddp.module``), whose parameters the loss must reach.
            tau_factor: ``tau = tau_factor * r``; in (0, 1).
            rank: ``r``, the subspace rank (None: ``d_head``).
            layout: where the projections are, for a model the agent's adapters do not know.

        Raises:
            ValueError: ``tau_factor`` outside (0, 1) or ``rank < 1``.
            qkwatch.agent.models.adapters.AdapterError: no attention found.
        """
        if not 0 < tau_factor < 1:
            raise ValueError(f"tau_factor must lie in (0, 1), got {tau_factor}")
        if rank is not None and rank < 1:
            raise ValueError(f"rank must be >= 1 or None, got {rank}")
        self.tau_factor = tau_factor
        self.rank = rank
        self.sites: list[Site] = find_sites(model, layout)

    @property
    def n_layers(self) -> int:
        return len(self.sites)

    def terms(self, lambdas: Sequence[float]) -> list[Tensor | None]:
        """``lambda_l * PAR_l`` per layer; None where ``lambda_l`` is 0 (nothing computed, nothing added).

        Raises:
            ValueError: ``lambdas`` of the wrong length, or a negative or non-finite value.
        """
        if len(lambdas) != len(self.sites):
            raise ValueError(f"{len(lambdas)} lambdas for a model of {len(self.sites)} attention layers")
        bad = [(i, v) for i, v in enumerate(lambdas) if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"lambdas must be finite and >= 0, got (layer, value) {bad}")
        return [self._layer(site) * lam if lam > 0 else None for site, lam in zip(self.sites, lambdas, strict=True)]

    def __call__(self, lambdas: Sequence[float] | None) -> Tensor:
        """The loss term: a differentiable scalar; 0 (no graph) when no lambda is positive or ``lambdas`` is None."""
        terms = [t for t in self.terms(lambdas) if t is not None] if lambdas is not None else []
        if not terms:
            return torch.zeros((), device=self._device())
        return torch.stack(terms).sum()

    def _layer(self, site: Site) -> Tensor:
        """``sum_h ReLU(sum_i c_i^2 - tau)^2`` of one layer."""
        wq, wk, _ = site.weights()  # (H, D, hs), (G, D, hs); the rotation leaves the subspace alone
        return par_penalty(wq, wk, self.rank, tau_factor=self.tau_factor)

    def _device(self) -> torch.device:
        return self.sites[0].weights()[0].device if self.sites else torch.device("cpu")


def par_loss(
    model: nn.Module,
    lambdas: Sequence[float] | None,
    *,
    tau_factor: float = TAU_FACTOR,
    rank: int | None = None,
    layout: Layout | None = None,
) -> Tensor:
    """``sum_l lambda_l * sum_h ReLU(sum_i c_i^2 - tau)^2`` over the layers with ``lambda_l > 0``.

    A one-call :class:`ParLoss` (it finds the layers on every call; a loop keeps a ``ParLoss``).

    Args:
        model: the unwrapped model (its parameters are what the gradient reaches).
        lambdas: per-layer weights, e.g. ``agent.lambdas()``; None (an agent that gives none) adds 0.
        tau_factor: ``tau = tau_factor * r`` (seed 000: 0.45).
        rank: ``r`` (None: ``d_head``).
        layout: for a model the agent's adapters do not know.

    Returns:
        A scalar tensor ``>= 0`` on the model's device, differentiable in the query and key projections.
    """
    return ParLoss(model, tau_factor=tau_factor, rank=rank, layout=layout)(lambdas)
