"""Query-key subspace geometry of the weights: QKAI, the principal-angle overlap, stable rank.

For one head, ``Wq`` and ``Wk`` are ``d_model x d_head`` (math layout). Everything here reduces
them to ``d_head x d_head`` objects through three Gram products

    Gq = Wq^T Wq,   Gk = Wk^T Wk,   X = Wq^T Wk

so that nothing ``d_model x d_model`` is ever formed and the batched work is matrix products.

* Full rank ``r = d_head``: Cholesky ``G = L L^T`` makes ``U = W L^{-T}`` an orthonormal basis of
  the column space (Cholesky QR, ``W = U R`` with ``R = L^T``), so the cosines of the principal
  angles are the singular values of ``C = Lq^{-1} X Lk^{-T}`` and ``sum_i c_i^2 = ||C||_F^2``:
  no SVD at all.
* ``r < d_head``: the top-r left-singular vectors of ``W`` are ``W V_r Lambda_r^{-1/2}`` with
  ``(V, Lambda)`` the eigenpairs of ``G``, so ``C = Lambda_q^{-1/2} V_q^T X V_k Lambda_k^{-1/2}``.
* Stable rank of ``M = Wq Wk^T``: with ``W = U R``, ``M = Uq (Rq Rk^T) Uk^T`` has the singular
  values of the ``d_head x d_head`` core ``Rq Rk^T``.

Gram products square the condition number, so each head's result carries a rounding error of
about ``u * kappa(W)^2``. Heads whose estimated error exceeds ``ACCURACY`` are recomputed in
float64, and those still too ill-conditioned (or rank-deficient) with Householder QR in float64.
A head whose weights hold a NaN or inf gives NaN: a diverging run still reports.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from qkwatch.agent.metrics.cascade import Grams, cascade, finite_heads, finite_or_eye
from qkwatch.agent.metrics.heads import group_heads

Method = Literal["auto", "exact", "randomized"]

ACCURACY = 1e-5
"""Target absolute error of ``sum_i c_i^2 / r`` from rounding; the cascade keeps every head within it."""

RANDOMIZED_OVERSAMPLE = 8
RANDOMIZED_NITER = 4
RANDOMIZED_TOLERANCE = 1e-3
"""Randomised mode (a seeded range finder as in ``torch.svd_lowrank``, ``q = r + 8``, 4 power
iterations): absolute error of ``qkai`` within 1e-3 when the weights have a spectral gap
``sigma_{r+1} / sigma_r <= 0.5`` at the cut (tested). Without a gap the top-r subspace itself is
ill-defined, exact or not."""


def qkai(
    wq: Tensor, wk: Tensor, rank: int | None = None, *, method: Method = "auto", dtype: torch.dtype | None = None
) -> Tensor:
    """Query-key alignment index per head: ``mean_i c_i^2``.

    ``c_i`` are the cosines of the principal angles between the top-``rank`` left-singular
    subspaces of ``Wq`` and ``Wk`` (default ``rank = d_head``: the whole column spaces).

    Args:
        wq: ``(..., n_heads, d_model, d_head)``.
        wk: ``(..., n_kv_heads, d_model, d_head)``; ``n_heads % n_kv_heads == 0`` (GQA), or any
            shape that broadcasts with ``wq``.
        rank: ``r``, ``1 <= r <= d_head``.
        method: ``"exact"``, ``"randomized"`` (a seeded randomised SVD) or ``"auto"`` (randomised
            only where it is faster, i.e. ``4 (r + 8) <= d_head``).
        dtype: compute dtype; float32 unless the weights are float64 or this asks for float64.

    Returns:
        ``(..., n_heads)`` in ``[0, 1]``; independent random subspaces give about ``r / d_model``.
    """
    r = _rank(wq, rank)
    return principal_overlap(wq, wk, r, method=method, dtype=dtype) / r


def principal_overlap(
    wq: Tensor,
    wk: Tensor,
    rank: int | None = None,
    *,
    method: Method = "auto",
    dtype: torch.dtype | None = None,
    refine: bool = True,
) -> Tensor:
    """``sum_i c_i^2`` per head, differentiable in ``wq`` and ``wk`` (RAA's PAR loss uses it).

    Same arguments and shapes as :func:`qkai`; the range is ``[0, r]``. ``refine=False`` skips the
    float64 recomputation of ill-conditioned heads: no data-dependent branch, so no host
    synchronisation and nothing for ``torch.compile`` to break on, at the price of an error of
    about ``0.003 u kappa(W)^2`` on those heads (a training loss inside a forward wants that).
    """
    _check_pair(wq, wk)
    r = _rank(wq, rank)
    d = wq.shape[-1]
    dt = _compute_dtype(wq, dtype)
    if _use_randomized(method, r, d):
        return _overlap_randomized(wq, wk, r, dt)
    if r == d:
        return cascade(wq, wk, dt, _full_rank_overlap, _householder_overlap, refine=refine)
    return cascade(wq, wk, dt, partial(_top_r, r=r), partial(_svd_top_r, r=r), refine=refine)


def stable_rank(wq: Tensor, wk: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Stable rank ``||M||_F^2 / ||M||_2^2`` of ``M = Wq Wk^T`` per head, without forming ``M``.

    Args:
        wq, wk: as in :func:`qkai`. Pass the effective key map (``effective_key_map``) when
            the model rotates its keys.

    Returns:
        ``(..., n_heads)`` in ``[1, d_head]``.
    """
    _check_pair(wq, wk)
    return cascade(wq, wk, _compute_dtype(wq, dtype), _full_rank, _householder)[..., 1]


def geometry(wq: Tensor, wk: Tensor, rank: int | None = None, *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """QKAI, stable rank and column alignment per head from one shared pass (what the agent reports).

    Returns ``{"qkai", "stable_rank", "qk_cos"}``, each ``(..., n_heads)``; ``qk_cos`` is the mean
    over the head's output features of ``|cos(Wq[:, j], Wk[:, j])|``, read off the Grams' diagonals
    (the layer's ``qk_cos`` is the mean over heads).
    """
    _check_pair(wq, wk)
    r = _rank(wq, rank)
    dt = _compute_dtype(wq, dtype)
    values = cascade(wq, wk, dt, _full_rank, _householder)
    out = {"qkai": values[..., 0] / r, "stable_rank": values[..., 1], "qk_cos": values[..., 2]}
    if r < wq.shape[-1]:
        out["qkai"] = qkai(wq, wk, r, dtype=dt)
    return out


# --- the tiers ------------------------------------------------------------------------------


def _full_rank(grams: Grams, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cholesky QR of both factors: ``[..., (sum c_i^2, stable rank, qk_cos)]`` and trustworthy."""
    lq, ok_q = _cholesky(grams.q, dt)  # (..., hs, hs)
    lk, ok_k = _cholesky(grams.k, dt)
    c = torch.linalg.solve_triangular(lq, grams.x, upper=False)  # Lq^{-1} X
    c = torch.linalg.solve_triangular(lk, c.mT, upper=False).mT  # Lq^{-1} X Lk^{-T}
    overlap = c.square().sum((-2, -1))
    srank = _stable_rank_of_core(lq.mT @ lk)  # Rq Rk^T with R = L^T
    return torch.stack([overlap, srank, grams.column_cos()], -1), ok_q & ok_k & grams.finite


def _full_rank_overlap(grams: Grams, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cholesky QR of both factors: ``sum c_i^2`` alone (no stable rank: nothing to decompose)."""
    lq, ok_q = _cholesky(grams.q, dt)
    lk, ok_k = _cholesky(grams.k, dt)
    c = torch.linalg.solve_triangular(lq, grams.x, upper=False)
    c = torch.linalg.solve_triangular(lk, c.mT, upper=False).mT
    return c.square().sum((-2, -1)), ok_q & ok_k & grams.finite


def _top_r(grams: Grams, dt: torch.dtype, r: int) -> tuple[Tensor, Tensor]:
    """Eigenpairs of the Grams: (sum of the top-r c_i^2, trustworthy) per head."""
    bq, ok_q = _top_r_basis(grams.q, r, dt)  # U_Q = Wq Bq, Bq (..., hs, r)
    bk, ok_k = _top_r_basis(grams.k, r, dt)
    c = bq.mT @ grams.x @ bk  # (..., r, r)
    return c.square().sum((-2, -1)), ok_q & ok_k & grams.finite


def _householder(wq: Tensor, wk: Tensor) -> tuple[Tensor, Tensor]:
    """Last resort for full rank, float64 Householder QR: ``[..., (sum c_i^2, stable rank, qk_cos)]``, defined.

    A rank-deficient head (dead, zeroed) has no ``d_head``-dimensional column space, so its
    overlap is not defined; its stable rank is, unless ``M = 0``.
    """
    uq, rq = torch.linalg.qr(wq.double())
    uk, rk = torch.linalg.qr(wk.double())
    overlap = (uq.mT @ uk).square().sum((-2, -1))
    srank = _stable_rank_of_core(rq @ rk.mT)
    diag = torch.cat([rq.diagonal(dim1=-2, dim2=-1), rk.diagonal(dim1=-2, dim2=-1)], -1).abs()
    full_rank = _well_separated(diag.amin(-1), diag.amax(-1), wq)
    nonzero = srank.isfinite()  # the stable rank needs only M != 0
    cos = Grams.of(wq, wk, torch.float64).column_cos()
    return torch.stack([overlap, srank, cos], -1), torch.stack([full_rank, nonzero, cos.isfinite()], -1)


def _householder_overlap(wq: Tensor, wk: Tensor) -> tuple[Tensor, Tensor]:
    values, defined = _householder(wq, wk)
    return values[..., 0], defined[..., 0]


def _svd_top_r(wq: Tensor, wk: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Last resort for ``r < d_head``, float64 SVD: top-r overlap, defined (a gap at the cut)."""
    uq, sq, _ = torch.linalg.svd(wq.double(), full_matrices=False)
    uk, sk, _ = torch.linalg.svd(wk.double(), full_matrices=False)
    overlap = (uq[..., :r].mT @ uk[..., :r]).square().sum((-2, -1))
    gap = torch.minimum(sq[..., r - 1] - _after(sq, r), sk[..., r - 1] - _after(sk, r))
    return overlap, _well_separated(gap, torch.maximum(sq[..., 0], sk[..., 0]), wq)


def _after(s: Tensor, r: int) -> Tensor:
    return s[..., r] if r < s.shape[-1] else torch.zeros_like(s[..., 0])


def _well_separated(small: Tensor, big: Tensor, w: Tensor) -> Tensor:
    return small > big * w.shape[-2] * torch.finfo(torch.float64).eps


def _overlap_randomized(wq: Tensor, wk: Tensor, r: int, dt: torch.dtype) -> Tensor:
    qg, kg, shape = group_heads(wq, wk)
    uq = _randomized_top_r(finite_or_eye(qg.to(dt)), r)
    uk = _randomized_top_r(finite_or_eye(kg.to(dt)), r)
    overlap = (uq.mT @ uk).square().sum((-2, -1))
    bad = ~(finite_heads(qg) & finite_heads(kg))
    return overlap.masked_fill(bad, math.nan).reshape(shape)


def _randomized_top_r(w: Tensor, r: int) -> Tensor:
    """Top-r left-singular vectors by a randomised range finder with power iterations.

    The algorithm of ``torch.svd_lowrank`` (Halko, Martinsson & Tropp 2011, alg. 4.4), with its
    own seeded generator: the result is deterministic and the training run's global RNG stream
    is left untouched.
    """
    q = min(r + RANDOMIZED_OVERSAMPLE, w.shape[-1])
    gen = torch.Generator(device=w.device).manual_seed(0)
    omega = torch.randn(w.shape[-1], q, generator=gen, device=w.device, dtype=w.dtype)  # (hs, q)
    basis: Tensor = torch.linalg.qr(w @ omega).Q  # (..., D, q)
    for _ in range(RANDOMIZED_NITER):
        basis = torch.linalg.qr(w.mT @ basis).Q  # (..., hs, q)
        basis = torch.linalg.qr(w @ basis).Q  # (..., D, q)
    u_small: Tensor = torch.linalg.svd(basis.mT @ w, full_matrices=False).U  # (..., q, q)
    return (basis @ u_small)[..., :r]


# --- small pieces ---------------------------------------------------------------------------


def _cholesky(gram: Tensor, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cholesky factor and whether its rounding error keeps ``sum c_i^2 / r`` within ACCURACY.

    Measured (random orthogonal bases, log-spaced spectra, d_model 2048, d_head 128, float32):
    the error of the Gram route is about ``0.003 u kappa(W)^2``, and ``est = (max L_ii / min L_ii)^2``
    grows at least as fast as ``kappa(W)^1.3``. Accepting ``u est^2 <= ACCURACY`` is therefore
    conservative by well over an order of magnitude; in float32 it passes heads up to
    ``kappa(W)`` of about 10, and the rest are recomputed in float64.
    """
    chol, info = torch.linalg.cholesky_ex(gram)
    diag = chol.diagonal(dim1=-2, dim2=-1).abs()
    est = (diag.amax(-1) / diag.amin(-1).clamp_min(torch.finfo(dt).tiny)).square()
    ok = (info == 0) & (_unit(dt) * est.square() <= ACCURACY)
    return chol, ok & torch.isfinite(est)


def _top_r_basis(gram: Tensor, r: int, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Top-r eigenbasis ``V_r Lambda_r^{-1/2}`` and whether it keeps ACCURACY.

    Here the condition number of the top-r part is known exactly, ``lambda_1 / lambda_r``; the
    error is about ``0.003 u lambda_1 / lambda_r``, accepted with a factor 30 of margin. The
    top-r subspace also needs a gap at the cut that rounding cannot close.
    """
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    lam = evals[..., -r:].clamp_min(torch.finfo(dt).tiny)  # (..., r)
    basis = evecs[..., -r:] * lam.rsqrt().unsqueeze(-2)  # (..., hs, r)
    ok = 0.1 * _unit(dt) * evals[..., -1] / lam[..., 0] <= ACCURACY
    if r < gram.shape[-1]:
        gap = (evals[..., -r] - evals[..., -r - 1]) / evals[..., -1]
        ok = ok & (gap > 1e3 * _unit(dt))
    return basis, ok


def _stable_rank_of_core(core: Tensor) -> Tensor:
    fro2 = core.square().sum((-2, -1))
    spec2: Tensor = torch.linalg.eigvalsh(core.mT @ core)[..., -1]
    return fro2 / spec2


def _unit(dt: torch.dtype) -> float:
    return torch.finfo(dt).eps / 2


def _compute_dtype(w: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"compute dtype must be torch.float32 or torch.float64, got {dtype}")
        return dtype
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def _rank(wq: Tensor, rank: int | None) -> int:
    d = wq.shape[-1]
    if rank is None:
        return d
    if not 1 <= int(rank) <= d:
        raise ValueError(f"rank must be in [1, d_head={d}], got {rank}")
    return int(rank)


def _use_randomized(method: Method, r: int, d: int) -> bool:
    if method not in ("auto", "exact", "randomized"):
        raise ValueError(f"method must be 'auto', 'exact' or 'randomized', got {method!r}")
    if method == "auto":
        # Measured (bench/metrics.py): the exact top-r path pays for an eigendecomposition of each
        # Gram; the range finder wins while its sketch is at most a quarter of the head.
        return 4 * (r + RANDOMIZED_OVERSAMPLE) <= d
    return method == "randomized"


def _check_pair(wq: Tensor, wk: Tensor) -> None:
    if wq.ndim < 2 or wk.ndim < 2:
        raise ValueError(f"wq and wk must be (..., d_model, d_head); got {tuple(wq.shape)} and {tuple(wk.shape)}")
    if wq.shape[-2:] != wk.shape[-2:]:
        raise ValueError(
            f"wq {tuple(wq.shape)} and wk {tuple(wk.shape)} differ in (d_model, d_head) = "
            f"{tuple(wq.shape[-2:])} vs {tuple(wk.shape[-2:])}"
        )
    d_model, d_head = wq.shape[-2:]
    if d_head > d_model:
        raise ValueError(
            f"d_head={d_head} exceeds d_model={d_model}: expected math layout (..., d_model, d_head); "
            "an nn.Linear weight needs split_heads first"
        )
