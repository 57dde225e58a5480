"""RAA's Householder key rotation (seed 000): per key head ``R_g = H_1 ... H_p``, folded into the key
projection by :meth:`KeyRotation.fold` (``k = R_g W_k x``, then RoPE)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkwatch.agent.metrics import householder


class KeyRotation(nn.Module):
    """RAA's per-head Householder key rotation ``R_g = H_1 ... H_p``, ``H_i = I - 2 v_i v_i^T / |v_i|^2``.

    Orthogonal by construction (norms of keys are preserved). ``p`` is even and the vectors come in
    equal pairs at initialisation (``H(v) H(v) = I``), so the rotation starts as the identity.
    """

    def __init__(self, n_kv_heads: int, reflections: int, d_head: int) -> None:
        super().__init__()
        self.vectors = nn.Parameter(torch.empty(n_kv_heads, reflections, d_head))

    def matrix(self) -> Tensor:
        """``(n_kv_heads, d_head, d_head)`` rotation in float32 (applied to a key column as ``R @ k``)."""
        return householder(self.vectors.float())

    def wy(self) -> tuple[Tensor, Tensor]:
        """Compact WY form ``R = H_1 ... H_p = I - V^T T V``, returned as ``(V, T^T V)``.

        ``V (G, p, d)`` holds the reflection vectors as rows; ``T (G, p, p)`` is upper triangular with
        ``T^{-1} = diag(|v_j|^2 / 2) + triu(V V^T, 1)`` (Joffrain et al. 2006), so ``T^T V`` is one
        triangular solve, a handful of kernels per layer whatever ``p``.
        """
        v = self.vectors.float()  # (G, p, d)
        gram = v @ v.mT  # (G, p, p)
        t_inv = torch.diag_embed(gram.diagonal(dim1=-2, dim2=-1) / 2) + gram.triu(1)
        return v, torch.linalg.solve_triangular(t_inv.mT, v, upper=False)  # T^T V = (T^{-1})^{-T} V

    def fold(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The key projection with the rotation folded in: ``W' = R_g W_g`` and ``b' = R_g b_g`` per head.

        ``weight`` is ``(G * d, d_model)`` (``nn.Linear`` layout). In the compact WY form that is
        ``4 p G d d_model`` flops on the weights whatever the number of tokens, instead of the same
        per token on the keys.
        """
        v, tv = (t.to(weight.dtype) for t in self.wy())  # (G, p, d): R = I - V^T T V, tv = T^T V
        g, _, d = v.shape
        w = weight.view(g, d, -1)  # (G, d, D)
        folded = (w - tv.mT @ (v @ w)).reshape(g * d, -1)  # R W = W - (T^T V)^T (V W): inner size p
        if bias is None:
            return folded, None
        b = bias.view(g, d, 1).to(weight.dtype)
        return folded, (b - tv.mT @ (v @ b)).reshape(-1).to(bias.dtype)

    def forward(self, k: Tensor) -> Tensor:
        """``k (B, G, T, d) -> R_g k`` as ``k - (k V^T) (T^T V)``: two skinny products (inner size p).

        That is ``4 p d`` flops per key instead of ``2 d^2`` for the matrix, in a few passes over the
        keys instead of the ``4 p`` of reflecting one vector at a time. The keys come from a
        ``(B, T, G, d)`` projection, so the products run in that layout (no copy to ``(B, G, T, d)``).
        """
        v, w = self.wy()
        kt = k.transpose(1, 2)  # (B, T, G, d)
        coef = torch.einsum("btgd,gpd->btgp", kt, v.to(k.dtype))  # (B, T, G, p)
        return (kt - torch.einsum("btgp,gpd->btgd", coef, w.to(k.dtype))).transpose(1, 2)  # (B, G, T, d)
