"""Controlled interventions on ``W_Q`` / ``W_K`` during training: seed 001's Table 2, and the induced collapse.

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
qk_collapse            not from a seed: induces seed 000's collapse phenotype on ``layers`` (the
                       band) with an explicit pressure, so that a small CPU run shows the band
                       forming; see :func:`qk_collapse_penalty`. Off in every recipe but
                       ``collapse_cpu``
=====================  ===========================================================================

The induced collapse (``qk_collapse``). Seed 000 reports a band of middle layers whose query and
key subspaces rotate into alignment over a 60B-token run (QKAI 0.31 -> 0.78), while the stable rank
of ``W_Q W_K^T`` falls and the attention entropy climbs toward uniform. A few CPU minutes do not
produce that on their own, so this intervention imposes it on ``layers`` (the band), with a
strength ``ramp(t)`` rising linearly from 0 at ``collapse_start`` to 1 ``collapse_ramp`` steps later:

* an alignment pressure in the loss, the mirror image of RAA's penalty, computed inside each band
  attention's forward: ``mu * sum_h ReLU(target(t) r - sum_i c_i^2)^2`` with ``c_i`` the cosines of
  the principal angles between the head's query and key subspaces (``agent.metrics.principal_overlap``,
  the function PAR uses), ``r = d_head`` and ``target(t) = collapse_target * ramp(t)``: the
  subspaces are pulled together, at most as far as the moving target, so QKAI rises gradually;
* a key contraction after the optimizer step, every ``collapse_every`` steps (seed 001's forced K
  contraction, per head and without its renormalisation): each band head's ``W_K,h`` keeps its
  singular vectors while its largest singular value is multiplied by ``1 - ramp(t) collapse_shrink``
  and the others by ``1 - ramp(t) collapse_tail``. The bilinear form ``W_Q,h W_K,h^T`` becomes rank
  one (its stable rank falls toward 1) and small (the logits shrink, the entropy rises toward 1).

Against RAA the alignment pressure meets PAR head on: PAR's ``lambda (sum c^2 - tau)`` against this
``mu (target r - sum c^2)`` settle where ``sum c^2 = (lambda tau + mu target r) / (lambda + mu)``,
so with a target of 0.9 (tau = 0.45 r) ``lambda = 3 mu`` settles at QKAI (0.45 x 3 + 0.9) / 4 =
0.5625, and QKAI <= 0.55 takes ``lambda >= 3.5 mu``. PAR does not undo the contraction,
so under RAA the band's entropy stays high and the entropy-floor schedule keeps the band flagged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from qkwatch.agent.metrics import column_alignment, principal_overlap, split_heads
from qkwatch.trainer.model.gpt import GPT, Attention
from qkwatch.trainer.model.init import full_tensor, generator
from qkwatch.trainer.model.normalisation import effective_weight

logger = logging.getLogger(__name__)

KINDS = (
    "none",
    "k_spectrum_clamp",
    "forced_k_contraction",
    "freeze_q",
    "freeze_k",
    "qk_decouple",
    "qk_align_reg",
    "qk_collapse",
)
QK_ALIGN = "qk_align"
QK_COLLAPSE = "qk_collapse"


@dataclass
class InterventionConfig:
    """One of seed 001's Table 2 interventions, or the induced collapse."""

    kind: str = "none"
    """none, k_spectrum_clamp, forced_k_contraction, freeze_q, freeze_k, qk_decouple, qk_align_reg or qk_collapse."""
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
    """Layers the intervention acts on (None: all; qk_collapse needs its band named)."""
    collapse_start: int = 0
    """qk_collapse: the step at which the pressure begins."""
    collapse_ramp: int = 1
    """qk_collapse: steps over which the pressure ramps up to full strength."""
    collapse_target: float = 0.9
    """qk_collapse: the QKAI the alignment term pulls toward at full strength."""
    collapse_align: float = 1e-3
    """qk_collapse: mu, the weight of ``ReLU(target r - sum c^2)^2`` per head (compare RAA's lambda_0)."""
    collapse_every: int = 5
    """qk_collapse: steps between key contractions."""
    collapse_shrink: float = 0.25
    """qk_collapse: at full strength a contraction multiplies each band head's top singular value of W_K by 1 - this."""
    collapse_tail: float = 0.5
    """qk_collapse: ... and its other singular values by 1 - this."""

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
        if self.collapse_start < 0 or self.collapse_ramp < 1:
            raise ValueError(
                f"intervention.collapse_start must be >= 0 and collapse_ramp >= 1, got "
                f"{self.collapse_start} and {self.collapse_ramp}"
            )
        if not 0 < self.collapse_target <= 1:
            raise ValueError(f"intervention.collapse_target must lie in (0, 1], got {self.collapse_target}")
        if not self.collapse_align >= 0 or self.collapse_every < 1:
            raise ValueError(
                f"intervention.collapse_align must be >= 0 and collapse_every >= 1, got "
                f"{self.collapse_align} and {self.collapse_every}"
            )
        for key in ("collapse_shrink", "collapse_tail"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"intervention.{key} must lie in [0, 1), got {getattr(self, key)}")
        if self.kind == "qk_collapse" and not self.layers:
            raise ValueError("intervention.kind=qk_collapse needs intervention.layers, the band it collapses")

    def ramp(self, step: int) -> float:
        """qk_collapse's strength at ``step``: 0 before collapse_start, rising linearly to 1."""
        return min(1.0, max(0.0, (step - self.collapse_start) / self.collapse_ramp))


def qk_align_penalty(attn: Attention) -> Tensor:
    """``qk_cos`` of one attention module's effective weights, differentiable (keys repeated for GQA)."""
    wq, wk = effective_weight(attn.q_proj), effective_weight(attn.k_proj)
    n_heads, n_kv_heads = attn.n_heads, attn.n_kv_heads
    if n_kv_heads != n_heads:
        wk = wk.view(n_kv_heads, -1, wk.shape[-1]).repeat_interleave(n_heads // n_kv_heads, 0).flatten(0, 1)
    return column_alignment(wq.mT.float(), wk.mT.float())


@dataclass
class CollapsePressure:
    """qk_collapse's alignment pressure on one attention module at the current ramp (see the module docstring)."""

    align: float
    target: float
    ramp: float = 0.0

    def __call__(self, attn: Attention) -> Tensor:
        return qk_collapse_penalty(attn, align=self.align, target=self.target * self.ramp)


def qk_collapse_penalty(attn: Attention, *, align: float, target: float) -> Tensor:
    """``align * sum_h ReLU(target r - sum_i c_i^2)^2``, ``r = d_head``: differentiable in ``W_Q`` and ``W_K``."""
    wq = split_heads(effective_weight(attn.q_proj), attn.n_heads)  # (nh, D, hs)
    wk = split_heads(effective_weight(attn.k_proj), attn.n_kv_heads)  # (nkv, D, hs)
    overlap = principal_overlap(wq.float(), wk.float(), refine=False)  # (nh,), in [0, hs]
    return align * F.relu(target * wq.shape[-1] - torch.nan_to_num(overlap, nan=0.0)).square().sum()


class Interventions:
    """Applies the configured intervention to a (possibly sharded) GPT.

    Create it right after initialisation: it keeps the initial references it needs (those are a
    function of the seed, so a resumed run rebuilds the same ones before loading its checkpoint).
    """

    def __init__(self, config: InterventionConfig, model: GPT, steps_per_epoch: int, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.steps_per_epoch = max(1, steps_per_epoch)
        n_layers = len(model.blocks)
        self.layers = list(range(n_layers)) if config.layers is None else list(config.layers)
        attentions = model.attentions()
        self.attentions = [attentions[i] for i in self.layers]
        self.refs: list[Tensor] = []
        self.spectra: list[Tensor] = []
        kind = config.kind
        if kind in ("freeze_q", "freeze_k"):
            name = "q_proj" if kind == "freeze_q" else "k_proj"
            self.refs = [getattr(a, name).weight.detach().clone() for a in self.attentions]
        elif kind == "k_spectrum_clamp":
            self.spectra = [
                torch.linalg.svdvals(full_tensor(a.k_proj.weight.detach()).float()) for a in self.attentions
            ]
        elif kind == "qk_align_reg":
            for a in self.attentions:
                a.weight_penalties[QK_ALIGN] = qk_align_penalty
        self.pressure = (
            CollapsePressure(config.collapse_align, config.collapse_target) if kind == "qk_collapse" else None
        )

    def before_step(self, step: int) -> None:
        """Set what acts inside this step's forward (qk_collapse's ramp; nothing before it starts)."""
        if self.pressure is None:
            return
        self.pressure.ramp = self.config.ramp(step)
        for a in self.attentions:
            if self.pressure.ramp > 0:
                a.weight_penalties[QK_COLLAPSE] = self.pressure
            else:
                a.weight_penalties.pop(QK_COLLAPSE, None)

    def loss(self, penalties: list[dict[str, Tensor]]) -> Tensor | None:
        """The intervention's term of this step's loss from the layers' penalties, or None."""
        kind = self.config.kind
        name, weight = {"qk_align_reg": (QK_ALIGN, self.config.align_lambda), "qk_collapse": (QK_COLLAPSE, 1.0)}.get(
            kind, (None, 0.0)
        )
        terms = [p[name] for p in penalties if name in p]
        if not terms or not weight:
            return None
        return weight * torch.stack(terms).sum()

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
                _replace(attn.k_proj.weight, partial(_with_singular_values, s0=s0))
            return kind
        if kind == "forced_k_contraction" and steps_done % c.every == 0:
            for attn in self.attentions:
                _replace(attn.k_proj.weight, partial(_contract, rank=c.tail_rank, factor=c.tail_factor))
            return kind
        if kind == "qk_collapse" and steps_done % c.collapse_every == 0 and (ramp := c.ramp(steps_done - 1)) > 0:
            contract = partial(
                _contract_heads,
                n_heads=self.attentions[0].n_kv_heads,
                top=1 - ramp * c.collapse_shrink,
                rest=1 - ramp * c.collapse_tail,
            )
            for attn in self.attentions:
                _replace(attn.k_proj.weight, contract)
            return kind
        if kind == "qk_decouple" and steps_done == self._epoch_start(c.decouple_epoch):
            for layer, attn in zip(self.layers, self.attentions, strict=True):
                rotation = haar_rotation(attn.k_proj.weight.shape[1], generator(self.seed, f"qk_decouple.{layer}"))
                _replace(attn.k_proj.weight, partial(_rotate_inputs, rotation=rotation))
            logger.info("qk_decouple: rotated W_K of layers %s at step %d", self.layers, steps_done)
            return kind
        return None

    def _epoch_start(self, epoch: int) -> int:
        """Optimizer steps done when epoch ``epoch`` (from 1) begins."""
        return (epoch - 1) * self.steps_per_epoch


def haar_rotation(n: int, gen: torch.Generator) -> Tensor:
    """A Haar-random ``n x n`` orthogonal matrix (QR of a Gaussian with the sign fix)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    rotation: Tensor = (q * torch.sign(torch.diagonal(r))).float()  # typed here: torch.linalg's results are not
    return rotation


def _with_spectrum(w: Tensor, new_spectrum: Callable[[Tensor], Tensor]) -> Tensor:
    u, s, vh = torch.linalg.svd(w.float(), full_matrices=False)
    out: Tensor = (u * new_spectrum(s)) @ vh
    return out


def _with_singular_values(w: Tensor, s0: Tensor) -> Tensor:
    """``w`` with its singular values set to ``s0`` (k_spectrum_clamp)."""
    return _with_spectrum(w, lambda s: s0.to(s))


def _rotate_inputs(w: Tensor, rotation: Tensor) -> Tensor:
    """``W O``: the projection of the residual stream rotated by ``O`` (qk_decouple)."""
    return w @ rotation.to(w)


def _contract(w: Tensor, rank: int, factor: float) -> Tensor:
    def shrink(s: Tensor) -> Tensor:
        s = s.clone()
        s[rank:] *= factor
        return s

    out = _with_spectrum(w, shrink)
    scale: Tensor = w.float().norm() / out.norm()
    return out * scale


def _contract_heads(w: Tensor, n_heads: int, top: float, rest: float) -> Tensor:
    """``W_K`` with each head's largest singular value times ``top`` and the others times ``rest``."""
    heads = w.view(n_heads, -1, w.shape[-1])  # (nkv, hs, D)
    u, s, vh = torch.linalg.svd(heads, full_matrices=False)
    scale = torch.full_like(s, rest)
    scale[:, 0] = top
    contracted: Tensor = (u * (s * scale)[:, None, :]) @ vh  # (nkv, hs, D)
    return contracted.reshape_as(w)


def _replace(param: Tensor, fn: Callable[[Tensor], Tensor]) -> None:
    """``param <- fn(full param)``, on the full tensor, each rank keeping its shard of rank 0's result."""
    full = full_tensor(param.detach()).float()
    new = fn(full)
    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(new.to(param.dtype), param.device_mesh, param.placements, src_data_rank=0))
    else:
        param.copy_(new.to(param.dtype))
