"""q/k-norm: the gains of the RMS norms a model applies to its queries and keys, folded into the
weights qkwatch measures (docs/metrics.md#notation).

Qwen3, Gemma 3 and OLMo 2 (and torchtitan's, litgpt's and Megatron-core's models with their q/k
norm on) normalise each query and key before attending. The bilinear form they attend with is
``x^T Wq^T diag(g_q) diag(g_k) Wk x'``: the normalisation itself scales each token's query by one
positive number, which turns no direction, and the gains are a diagonal. :func:`with_qk_norm` makes
a site's weights ``Wq_h diag(g_q)`` and ``Wk_h diag(g_k)``. A q/k norm that is not an RMS norm (a
LayerNorm subtracts a mean, which no bilinear form holds) is left out, and said once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkwatch.agent.models.sites import Site

logger = logging.getLogger(__name__)

_WARNED: set[str] = set()


def with_qk_norm(site: Site, module: nn.Module, q_name: str, k_name: str) -> Site:
    """``site``, its weights carrying the gains of ``module``'s RMS norms named ``q_name`` and ``k_name``
    (as it was when the module has none)."""
    q_norm, k_norm = getattr(module, q_name, None), getattr(module, k_name, None)
    if not (isinstance(q_norm, nn.Module) and isinstance(k_norm, nn.Module)):
        return site
    if not all(_rms(n) for n in (q_norm, k_norm)):
        if type(q_norm).__name__ not in _WARNED:
            _WARNED.add(type(q_norm).__name__)
            logger.warning(
                "qkwatch leaves %s's q/k norms (%s) out of its weight metrics: only an RMS norm's gain is a "
                "bilinear form",
                site.name,
                type(q_norm).__name__,
            )
        return site
    site.weights = _normed(site.weights, q_norm, k_norm)
    return site


def _rms(norm: nn.Module) -> bool:
    return "RMSNorm" in type(norm).__name__ and isinstance(getattr(norm, "weight", None), Tensor)


def _normed(
    weights: Callable[[], tuple[Tensor, Tensor, Tensor | None]], q_norm: nn.Module, k_norm: nn.Module
) -> Callable[[], tuple[Tensor, Tensor, Tensor | None]]:
    """``weights`` with each head's columns scaled by its norm's gain: ``Wq_h diag(g_q)``, ``Wk_h diag(g_k)``."""

    def read() -> tuple[Tensor, Tensor, Tensor | None]:
        wq, wk, rotation = weights()
        return wq * gain(q_norm, wq), wk * gain(k_norm, wk), rotation

    return read


def gain(norm: nn.Module, w: Tensor) -> Tensor:
    """An RMS norm's gain, as the model applies it (``weight``, Gemma's ``1 + weight``, litgpt's unit
    offset): the norm of a constant vector, whose RMS is that constant (1e3: the epsilon moves the
    result by 1e-12 of itself), shaped to scale ``w (heads, D, hs)``'s columns: per head (a norm over
    one head's features, Qwen3, Gemma 3) or per head and feature (over all heads', OLMo 2)."""
    weight = norm.weight
    assert isinstance(weight, Tensor), "with_qk_norm checked it"
    probe = torch.full((weight.shape[-1],), 1e3, dtype=weight.dtype, device=weight.device)
    out: Tensor = norm.forward(probe).to(w.dtype)  # forward, not __call__: no hooks run
    heads, _, hs = w.shape[-3:]
    return out.view(1, 1, hs) if out.numel() == hs else out.view(heads, 1, hs)
