"""Per-layer summaries of the weight metrics, as reported: one call for a whole stack of layers."""

from __future__ import annotations

import torch
from torch import Tensor

from qkwatch.agent.metrics.heads import effective_key_map
from qkwatch.agent.metrics.spectra import projection_norms
from qkwatch.agent.metrics.subspace import geometry

HEAD_METRICS = ("qkai", "stable_rank", "qk_cos")


def weight_metrics(
    wq: Tensor,
    wk: Tensor,
    rotation: Tensor | None = None,
    *,
    rank: int | None = None,
    spectra: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The weight metrics of docs/metrics.md for a stack of layers.

    Args:
        wq: ``(..., n_heads, d_model, d_head)`` query factors (``split_heads``).
        wk: ``(..., n_kv_heads, d_model, d_head)`` key factors; ``n_heads % n_kv_heads == 0``.
        rotation: ``(..., n_kv_heads, d_head, d_head)`` key rotation or None; the bilinear-form
            metric (stable rank) uses the effective key map ``Wk R^T``. QKAI is unchanged by it:
            a rotation inside the head moves neither column space nor left-singular vectors.
        rank: ``r`` for QKAI (default ``d_head``).
        spectra: also the whole-projection norms and ``wk_erank`` (an SVD of each projection,
            the costly part for wide layers).

    Returns:
        ``(per_layer, per_head)``: name -> ``(...)`` and name -> ``(..., n_heads)``.
    """
    wk_eff = effective_key_map(wk, rotation)
    geo = geometry(wq, wk_eff, rank, dtype=dtype)
    per_layer = {
        "qkai": geo["qkai"].mean(-1),
        "qkai_max": geo["qkai"].amax(-1),
        "stable_rank": geo["stable_rank"].mean(-1),
        "qk_cos": geo["qk_cos"].mean(-1),  # every head has d_head columns: the mean over all columns
    }
    if spectra:
        nq, nk = projection_norms(_layer_matrix(wq)), projection_norms(_layer_matrix(wk))
        per_layer.update(
            wq_fro=nq["fro"], wk_fro=nk["fro"], wq_spec=nq["spec"], wk_spec=nk["spec"], wk_erank=nk["erank"]
        )
    return per_layer, {name: geo[name] for name in HEAD_METRICS}


def _layer_matrix(w: Tensor) -> Tensor:
    """``(..., n_heads, d_model, d_head)`` -> the whole projection ``(..., d_model, n_heads * d_head)``."""
    return w.transpose(-3, -2).flatten(-2)  # (..., D, nh, hs) -> (..., D, nh*hs)
