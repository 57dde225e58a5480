"""The normalising layers of the variants: sigma-Reparam's linear layer (``sigma_reparam``: the
weight scaled by ``gamma`` over its spectral norm, Zhai et al. 2023) and RMSNorm (``qk_norm``: queries
and keys over ``d_head``, Henry et al. 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SigmaReparamLinear(nn.Linear):
    """``nn.Linear`` with effective weight ``gamma / sigma(W) * W`` (sigma-Reparam, Zhai et al. 2023).

    ``sigma(W) = u^T W v`` with ``u``, ``v`` from power iteration (no gradient through them; the
    gradient through ``W`` in ``sigma`` is kept). One iteration per training forward; ``u`` is a
    persistent buffer so a resumed run continues the same estimate.
    """

    u: Tensor
    """``(out,)`` power-iteration vector (a buffer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gamma = nn.Parameter(torch.ones(1))
        self.register_buffer("u", F.normalize(torch.ones(out_features), dim=0))

    @torch.no_grad()
    def power_iteration(self, n: int = 1) -> None:
        w = self.weight.float()
        u = self.u
        for _ in range(n):
            v = F.normalize(w.mT @ u, dim=0)  # (in,)
            u = F.normalize(w @ v, dim=0)  # (out,)
        self.u.copy_(u)

    def effective_weight(self) -> Tensor:
        w = self.weight
        with torch.no_grad():
            v = F.normalize(w.float().mT @ self.u, dim=0)  # (in,)
        sigma = self.u @ (w.float() @ v)  # gradient flows through W
        return w * (self.gamma / sigma).to(w.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.training and torch.is_grad_enabled():
            self.power_iteration()
        return F.linear(x, self.effective_weight(), self.bias)


def effective_weight(linear: nn.Linear) -> Tensor:
    """The weight the layer really multiplies by (sigma-Reparam's scaled one where that applies)."""
    return linear.effective_weight() if isinstance(linear, SigmaReparamLinear) else linear.weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
