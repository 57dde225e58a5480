"""The exact route of :mod:`qkwatch.agent.metrics.subspace`: the Gram products and the cascade
that keeps every head within ``ACCURACY``.

A tier computes every head from its three ``d_head x d_head`` Grams (:class:`Grams`) in the
compute dtype and says which heads to trust; :func:`cascade` recomputes the others in float64 with
the same tier, and those still untrusted by a last resort (float64 Householder QR or SVD on the
weights themselves). A head whose weights hold a NaN or inf gives NaN. On the CPU the first tier
runs in chunks of heads on worker threads (``qkwatch-geometry``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import NamedTuple

import torch
from torch import Tensor

from qkwatch.agent.metrics.heads import group_heads


class Grams(NamedTuple):
    """``Wq^T Wq``, ``Wk^T Wk``, ``Wq^T Wk`` per head; non-finite heads replaced by harmless ones."""

    q: Tensor
    k: Tensor
    x: Tensor
    finite: Tensor

    @classmethod
    def of(cls, wq: Tensor, wk: Tensor, dt: torch.dtype, *, sync: bool = True) -> Grams:
        wq, wk = wq.to(dt), wk.to(dt)
        gq, gk, x = wq.mT @ wq, wk.mT @ wk, wq.mT @ wk  # (..., hs, hs)
        # A NaN or inf anywhere in a head's weights reaches its Gram: checking the small Grams is
        # enough (a finite head whose Gram overflows is sent on to float64 like any other).
        finite = torch.isfinite(gq.sum((-2, -1)) + gk.sum((-2, -1)) + x.sum((-2, -1)))
        if not sync or not bool(finite.all()):  # without sync: always, instead of asking the device
            eye = torch.eye(gq.shape[-1], dtype=dt, device=gq.device)
            keep = finite[..., None, None]
            gq, gk, x = torch.where(keep, gq, eye), torch.where(keep, gk, eye), torch.where(keep, x, 0 * eye)
        return cls(gq, gk, x, finite)

    def column_cos(self) -> Tensor:
        """Mean over the head's columns ``j`` of ``|X_jj| / sqrt(Gq_jj Gk_jj)``."""
        dot = self.x.diagonal(dim1=-2, dim2=-1)
        norms = (self.q.diagonal(dim1=-2, dim2=-1) * self.k.diagonal(dim1=-2, dim2=-1)).sqrt()
        return (dot / norms).abs().mean(-1)


Tier = Callable[[Grams, torch.dtype], tuple[Tensor, Tensor]]
"""``tier(grams, dtype) -> (values, ok)``: one way to compute every head, and which to trust."""


LastResort = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""``last_resort(wq, wk) -> (values, defined)``: the float64 Householder/SVD route."""


def cascade(
    wq: Tensor, wk: Tensor, dt: torch.dtype, tier: Tier, last_resort: LastResort, *, refine: bool = True
) -> Tensor:
    """Run ``tier`` on every head in ``dt``, then recompute the untrustworthy heads more carefully.

    ``tier(grams, dtype) -> (values, ok)`` with values ``(*heads, ...)``. Heads with ``ok`` false
    are recomputed in float64 with the same tier, and those still not ok by
    ``last_resort(wq, wk) -> (values, defined)``; undefined heads and heads whose weights hold a
    NaN or inf give NaN. ``refine=False`` keeps the first tier's values (non-finite heads: NaN).
    """
    qg, kg, shape = group_heads(wq, wk)
    values, ok, finite = _first_tier(qg, kg, dt, tier, sync=refine)
    if not refine:
        values = torch.where(_expand_like(finite, values), values, torch.full_like(values, math.nan))
    elif not bool(ok.all()):  # one host sync per call, never one per head
        values = values.clone()
        values[~ok] = _refine(~ok, qg, kg, tier, last_resort).to(values.dtype)
    return values.reshape((*shape, *values.shape[ok.ndim :]))


def _first_tier(qg: Tensor, kg: Tensor, dt: torch.dtype, tier: Tier, *, sync: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``tier`` on every head: ``(values, ok, finite)``; on the CPU, in chunks on worker threads.

    The Grams are matrix products that use every core already, but the per-head LAPACK calls
    after them (two Cholesky factorisations, two triangular solves, one ``eigvalsh`` a head) run
    one matrix at a time on one core. Chunks of heads on ``2 x torch.get_num_threads()`` threads
    (torch lets go of the GIL inside its operators) overlap the two: 384 heads of bench/weight_pass.py's
    shape took 146-156 ms in 4 chunks against 190 ms in one pass on 2 cores (an ad hoc timing). Only
    without autograd and with more than one torch thread: a user who set ``torch.set_num_threads(1)``
    keeps one core.
    """

    def one(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        grams = Grams.of(q, k, dt, sync=sync)
        values, ok = tier(grams, dt)
        return values, ok, grams.finite

    chunks = _chunks(qg, kg)
    if chunks <= 1:
        return one(qg, kg)
    parts = list(_pool().map(one, qg.tensor_split(chunks), kg.tensor_split(chunks)))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


MIN_HEADS_PER_CHUNK = 16


def _chunks(qg: Tensor, kg: Tensor) -> int:
    threads = torch.get_num_threads()
    if threads <= 1 or qg.device.type != "cpu" or qg.ndim < 3 or kg.ndim != qg.ndim or qg.shape[0] != kg.shape[0]:
        return 1
    if torch.is_grad_enabled() and (qg.requires_grad or kg.requires_grad):
        return 1
    heads = math.prod(qg.shape[:-2])
    return max(1, min(2 * threads, qg.shape[0], heads // MIN_HEADS_PER_CHUNK, 8))


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="qkwatch-geometry")


def _refine(pending: Tensor, qg: Tensor, kg: Tensor, tier: Tier, last_resort: LastResort) -> Tensor:
    q = qg.expand(*pending.shape, *qg.shape[-2:])[pending]  # (n_pending, D, hs): copies these heads only
    k = kg.expand(*pending.shape, *kg.shape[-2:])[pending]
    finite = finite_heads(q) & finite_heads(k)
    q, k = finite_or_eye(q), finite_or_eye(k)
    values, ok = tier(Grams.of(q, k, torch.float64), torch.float64)
    if not bool(ok.all()):
        last, defined = last_resort(q[~ok], k[~ok])
        last = torch.where(_expand_like(defined, last), last, torch.full_like(last, math.nan))
        values = values.index_put(((~ok).nonzero(as_tuple=True)), last)
    return torch.where(_expand_like(finite, values), values, torch.full_like(values, math.nan))


def finite_heads(w: Tensor) -> Tensor:
    """``(..., D, hs) -> (...)``: whether each head's weights are all finite."""
    return torch.isfinite(w).all(-1).all(-1)


def finite_or_eye(w: Tensor) -> Tensor:
    """Replace each non-finite head by a well-conditioned stand-in (its result is masked to NaN)."""
    finite = finite_heads(w)
    if bool(finite.all()):
        return w
    stand_in = torch.eye(*w.shape[-2:], dtype=w.dtype, device=w.device)
    return torch.where(finite[..., None, None], w, stand_in)


def _expand_like(mask: Tensor, values: Tensor) -> Tensor:
    return mask.reshape(*mask.shape, *([1] * (values.ndim - mask.ndim)))
