"""Per-layer summaries of the weight metrics, as reported: one call for a whole stack of layers.

A metric of your own from the weights is one function registered with :func:`weight_metric`
(and one entry in the catalogue, ``qkwatch.contract.metrics``): every report then carries it per
layer (the mean over heads) and per head, and the collector, its exposition, the live page, the
report and the Grafana board follow the catalogue.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qkwatch.agent.metrics.heads import effective_key_map
from qkwatch.agent.metrics.spectra import projection_norms
from qkwatch.agent.metrics.subspace import geometry

HEAD_METRICS = ("qkai", "stable_rank", "qk_cos")

WeightMetric = Callable[[Tensor, Tensor], Tensor]
"""``(wq (..., n_heads, d_model, d_head), wk (..., n_kv_heads, d_model, d_head)) -> (..., n_heads)``:
a value per head (``wk`` is the effective key map, the key rotation applied)."""
REGISTERED: dict[str, WeightMetric] = {}
"""The weight metrics added with :func:`weight_metric`, by name."""


def weight_metric(name: str) -> Callable[[WeightMetric], WeightMetric]:
    """Register a per-head metric of the weights under ``name``; it is reported from the next report on::

    @weight_metric("wq_wk_ratio")
    def wq_wk_ratio(wq, wk):
        return wq.norm(dim=(-2, -1)) / wk.norm(dim=(-2, -1)).repeat_interleave(wq.shape[-3] // wk.shape[-3], -1)
    """

    def register(fn: WeightMetric) -> WeightMetric:
        if name in HEAD_METRICS or name in REGISTERED:
            raise ValueError(f"a weight metric named {name!r} exists already")
        REGISTERED[name] = fn
        return fn

    return register


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
    per_head = {name: geo[name] for name in HEAD_METRICS}
    for name, fn in REGISTERED.items():
        per_head[name] = fn(wq, wk_eff)
        per_layer[name] = per_head[name].float().mean(-1)
    return per_layer, per_head


def _layer_matrix(w: Tensor) -> Tensor:
    """``(..., n_heads, d_model, d_head)`` -> the whole projection ``(..., d_model, n_heads * d_head)``."""
    return w.transpose(-3, -2).flatten(-2)  # (..., D, nh, hs) -> (..., D, nh*hs)
