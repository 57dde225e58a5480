"""Spectral summaries: effective rank, participation ratio, column alignment, projection norms."""

from __future__ import annotations

import torch
from torch import Tensor


def effective_rank(s: Tensor) -> Tensor:
    """Effective rank ``exp(-sum_i p_i log p_i)``, ``p = s / sum(s)``, with ``0 log 0 = 0``.

    Args:
        s: ``(..., k)`` nonnegative singular values.

    Returns:
        ``(...)`` in ``[1, k]``: 1 for a one-hot spectrum, ``k`` for a flat one. An all-zero
        spectrum gives NaN (no direction at all).
    """
    if s.ndim < 1:
        raise ValueError(f"effective_rank expects (..., k) singular values, got shape {tuple(s.shape)}")
    total = s.sum(-1, keepdim=True)
    p = s / total
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    erank = torch.exp(-plogp.sum(-1))
    return torch.where(total.squeeze(-1) > 0, erank, torch.full_like(erank, float("nan")))  # NaN stays NaN


def participation_ratio(x: Tensor, rows: Tensor | None = None) -> Tensor:
    """Participation ratio ``(sum l)^2 / sum l^2 = tr(S)^2 / tr(S^2)`` of the sample covariance ``S``.

    ``S`` is the covariance of the rows of ``x`` (centred), ``l`` its eigenvalues. Works with the
    smaller of the two Grams (``n x n`` or ``width x width``), which share their nonzero
    eigenvalues; no eigendecomposition is needed.

    This is the plug-in estimator (seed 001's): it reads low from few rows. For Gaussian rows
    with covariance ``Sigma`` and ``n' = n - 1`` degrees of freedom, ``E tr(S) = tr(Sigma)`` and
    ``E tr(S^2) = tr(Sigma^2) (1 + 1/n') + tr(Sigma)^2 / n'``, so with ``PR = tr(Sigma)^2 / tr(Sigma^2)``::

        PR_hat ~ PR / (1 + (1 + PR) / n')

    For isotropic width ``w`` that is ``w n' / (n' + w + 1)``: about 50 from 64 rows of width 256,
    241 from 4,096 rows. The estimate is also capped at ``min(n - 1, width)``.

    Args:
        x: ``(..., n_samples, width)``, ``n_samples >= 2``.
        rows: ``(..., n_samples)`` 0/1 (or boolean): which rows count (a padding token's do not);
            the result is exactly that of ``x`` with the other rows dropped, at fixed shapes.

    Returns:
        ``(...)`` in ``[1, min(n_samples - 1, width)]``; isotropic data gives about ``width``
        (less the bias above).
    """
    if x.ndim < 2 or x.shape[-2] < 2:
        raise ValueError(f"participation_ratio expects (..., n_samples >= 2, width), got {tuple(x.shape)}")
    if rows is None:
        xc = x - x.mean(-2, keepdim=True)  # (..., n, w)
    else:
        if rows.shape != x.shape[:-1]:
            raise ValueError(
                f"participation_ratio: rows must have shape {tuple(x.shape[:-1])}, got {tuple(rows.shape)}"
            )
        keep = rows.to(x.dtype)[..., None]  # (..., n, 1)
        mean = (x * keep).sum(-2, keepdim=True) / keep.sum(-2, keepdim=True)
        xc = (x - mean) * keep  # rows left out are zero rows: they add nothing to either Gram
    n, w = xc.shape[-2:]
    gram = xc @ xc.mT if n <= w else xc.mT @ xc  # (..., min, min); the 1/(n-1) cancels in the ratio
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return trace.square() / gram.square().sum((-2, -1))


def column_alignment(wq: Tensor, wk: Tensor) -> Tensor:
    """``qk_cos``: mean over output features ``j`` of ``|cos(Wq[:, j], Wk[:, j])|``.

    Args:
        wq, wk: ``(..., d_model, width)``, whole-layer projections in math layout (the
            transpose of ``nn.Linear.weight``), or per-head factors (then average the result over
            heads); shapes broadcast. With GQA pass the keys repeated per query head.

    Returns:
        ``(...)`` in ``[0, 1]``; independent Xavier at ``d_model = 256`` gives about 0.0498
        (``E|cos| = sqrt(2 / (pi d_model))`` for independent isotropic columns).
    """
    try:
        if wq.shape != wk.shape:  # torch.broadcast_shapes costs tens of microseconds: only when needed
            torch.broadcast_shapes(wq.shape, wk.shape)  # type: ignore[no-untyped-call]  # unannotated in torch
    except RuntimeError:
        raise ValueError(f"column_alignment: wq {tuple(wq.shape)} and wk {tuple(wk.shape)} do not broadcast") from None
    dot = (wq * wk).sum(-2)
    norms: Tensor = wq.norm(dim=-2) * wk.norm(dim=-2)  # Tensor.norm is unannotated in torch
    return (dot / norms).abs().mean(-1)


def projection_norms(w: Tensor) -> dict[str, Tensor]:
    """Frobenius norm, spectral norm and effective rank of ``(..., d_model, width)`` projections.

    A projection holding a NaN or inf gives NaN for all three (the SVD never sees it).
    """
    w = w if w.dtype in (torch.float32, torch.float64) else w.float()
    finite = torch.isfinite(w).all(-1).all(-1)  # (...)
    s = torch.linalg.svdvals(torch.where(finite[..., None, None], w, torch.zeros_like(w)))
    s = torch.where(finite[..., None], s, torch.full_like(s, float("nan")))
    return {"fro": s.square().sum(-1).sqrt(), "spec": s[..., 0], "erank": effective_rank(s)}
