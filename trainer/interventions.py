"""Seed 001's controlled interventions (its Table 2), applied to ``W_Q`` / ``W_K`` during training.

``W_Q`` and ``W_K`` are a layer's whole projections (``nn.Linear`` weights, ``(out, in)``).
Epochs count from 1 as the paper does; ``steps_per_epoch`` comes from the data.

=====================  ===========================================================================
kind                   what happens (after the optimizer step)
=====================  ===========================================================================
k_spectrum_clamp       every ``every`` (100) steps from epoch ``start_epoch`` (1) on, ``W_K``'s
                       singular values are set back to those it had at initialisation
                       (``W_K <- U diag(s_init) V^T``)
forced_k_contraction   every ``every`` (100) steps, the singular values after rank ``tail_rank`` (32)
                       are multiplied by ``tail_factor`` (0.05), then ``W_K`` is rescaled to its
                       previous Frobenius norm ("renormalises the projection")
freeze_q / freeze_k    every step, ``W_Q`` (``W_K``) is restored to its initial value
qk_decouple            starts from ``W_K = W_Q`` (``init.qk_regime=qk_identical``); once, at the
                       first step of epoch ``decouple_epoch`` (3), ``W_K <- W_K O`` with ``O`` a
                       Haar-random rotation of the residual stream, so the key subspace becomes
                       unrelated to the query subspace
qk_align_reg           adds ``align_lambda * sum_l qk_cos_l`` (0.001) to the loss, ``qk_cos`` the
                       column alignment of ``agent.metrics``, computed in the attention's forward
=====================  ===========================================================================

Under FSDP2 the spectral interventions gather the full ``W_K`` on every rank (every 100 steps),
compute on it, and each rank keeps its shard of rank 0's result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from agent.metrics import column_alignment
from trainer.init import full_tensor, generator
from trainer.model import effective_weight

logger = logging.getLogger(__name__)

KINDS = ("none", "k_spectrum_clamp", "forced_k_contraction", "freeze_q", "freeze_k", "qk_decouple", "qk_align_reg")
QK_ALIGN = "qk_align"


@dataclass
class InterventionConfig:
    """One of seed 001's Table 2 interventions."""

    kind: str = "none"
    """none, k_spectrum_clamp, forced_k_contraction, freeze_q, freeze_k, qk_decouple or qk_align_reg."""
    every: int = 100
    """Period in optimizer steps of the spectral interventions."""
    start_epoch: int = 1
    """First epoch (from 1) of the K spectrum clamp."""
    tail_rank: int = 32
    """Forced K contraction keeps the top tail_rank singular values."""
    tail_factor: float = 0.05
    """Forced K contraction multiplies the rest by this factor."""
    decouple_epoch: int = 3
    """QK decouple rotates W_K once, at the first step of this epoch (from 1)."""
    align_lambda: float = 1e-3
    """Weight of the Q/K alignment regulariser."""
    layers: list[int] | None = None
    """Layers the intervention acts on (None: all)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"intervention.kind={self.kind!r} is not one of {', '.join(KINDS)}")
        for key in ("every", "start_epoch", "tail_rank", "decouple_epoch"):
            if getattr(self, key) < 1:
                raise ValueError(f"intervention.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.tail_factor <= 1:
            raise ValueError(f"intervention.tail_factor must lie in [0, 1], got {self.tail_factor}")
        if self.align_lambda < 0:
            raise ValueError(f"intervention.align_lambda must be >= 0, got {self.align_lambda}")


def qk_align_penalty(attn) -> Tensor:
    """``qk_cos`` of one attention module's effective weights, differentiable (keys repeated for GQA)."""
    wq, wk = effective_weight(attn.q_proj), effective_weight(attn.k_proj)
    n_heads, n_kv_heads = attn.n_heads, attn.n_kv_heads
    if n_kv_heads != n_heads:
        wk = wk.view(n_kv_heads, -1, wk.shape[-1]).repeat_interleave(n_heads // n_kv_heads, 0).flatten(0, 1)
    return column_alignment(wq.mT.float(), wk.mT.float())


class Interventions:
    """Applies the configured intervention to a (possibly sharded) GPT.

    Create it right after initialisation: it keeps the initial references it needs (those are a
    function of the seed, so a resumed run rebuilds the same ones before loading its checkpoint).
    """

    def __init__(self, config: InterventionConfig, model, steps_per_epoch: int, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.steps_per_epoch = max(1, steps_per_epoch)
        n_layers = len(model.blocks)
        self.layers = list(range(n_layers)) if config.layers is None else list(config.layers)
        self.attentions = [model.blocks[i].attn for i in self.layers]
        self.refs: list[Tensor] = []
        self.spectra: list[Tensor] = []
        kind = config.kind
        if kind in ("freeze_q", "freeze_k"):
            name = "q_proj" if kind == "freeze_q" else "k_proj"
            self.refs = [getattr(a, name).weight.detach().clone() for a in self.attentions]
        elif kind == "k_spectrum_clamp":
            self.spectra = [torch.linalg.svdvals(full_tensor(a.k_proj.weight.detach()).float())
                            for a in self.attentions]
        elif kind == "qk_align_reg":
            for a in self.attentions:
                a.weight_penalties[QK_ALIGN] = qk_align_penalty

    @property
    def weight(self) -> float:
        """Loss weight of the per-layer ``qk_align`` penalties."""
        return self.config.align_lambda if self.config.kind == "qk_align_reg" else 0.0

    @torch.no_grad()
    def after_step(self, steps_done: int) -> str | None:
        """Apply what is due after optimizer step number ``steps_done`` (from 1); returns its name."""
        c, kind = self.config, self.config.kind
        if kind in ("freeze_q", "freeze_k"):
            name = "q_proj" if kind == "freeze_q" else "k_proj"
            for attn, ref in zip(self.attentions, self.refs, strict=True):
                getattr(attn, name).weight.copy_(ref)
            return kind
        if kind == "k_spectrum_clamp" and steps_done % c.every == 0 and steps_done >= self._epoch_start(c.start_epoch):
            for attn, s0 in zip(self.attentions, self.spectra, strict=True):
                _replace(attn.k_proj.weight, lambda w, s0=s0: _with_spectrum(w, lambda s: s0.to(s)))
            return kind
        if kind == "forced_k_contraction" and steps_done % c.every == 0:
            for attn in self.attentions:
                _replace(attn.k_proj.weight, partial(_contract, rank=c.tail_rank, factor=c.tail_factor))
            return kind
        if kind == "qk_decouple" and steps_done == self._epoch_start(c.decouple_epoch):
            for layer, attn in zip(self.layers, self.attentions, strict=True):
                rotation = haar_rotation(attn.k_proj.weight.shape[1], generator(self.seed, f"qk_decouple.{layer}"))
                _replace(attn.k_proj.weight, lambda w, o=rotation: w @ o.to(w))
            logger.info("qk_decouple: rotated W_K of layers %s at step %d", self.layers, steps_done)
            return kind
        return None

    def _epoch_start(self, epoch: int) -> int:
        """Optimizer steps done when epoch ``epoch`` (from 1) begins."""
        return (epoch - 1) * self.steps_per_epoch


def haar_rotation(n: int, gen: torch.Generator) -> Tensor:
    """A Haar-random ``n x n`` orthogonal matrix (QR of a Gaussian with the sign fix)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _with_spectrum(w: Tensor, new_spectrum) -> Tensor:
    u, s, vh = torch.linalg.svd(w.float(), full_matrices=False)
    return (u * new_spectrum(s)) @ vh


def _contract(w: Tensor, rank: int, factor: float) -> Tensor:
    def shrink(s: Tensor) -> Tensor:
        s = s.clone()
        s[rank:] *= factor
        return s

    out = _with_spectrum(w, shrink)
    return out * (w.float().norm() / out.norm())


def _replace(param: Tensor, fn) -> None:
    """``param <- fn(full param)``, on the full tensor, each rank keeping its shard of rank 0's result."""
    full = full_tensor(param.detach()).float()
    new = fn(full)
    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(new.to(param.dtype), param.device_mesh, param.placements, src_data_rank=0))
    else:
        param.copy_(new.to(param.dtype))

