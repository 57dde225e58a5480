"""Rank-Anchored Attention's principal-angle regularisation (PAR, seed 000) of one layer.

    PAR = sum_h ReLU(sum_i c_i^2 - tau)^2,   tau = tau_factor * r,

``c_i`` the cosines of the principal angles between the top-``r`` query and key subspaces of head
``h`` (:func:`principal_overlap`). The one definition: the project's trainer computes it inside its
attention (``qkwatch.trainer.model.rank_anchored``) and any other loop on the agent's sites
(``qkwatch.raa``); each layer's term is then weighted by its lambda.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qkwatch.agent.metrics.subspace import Method, principal_overlap

TAU_FACTOR = 0.45
"""``tau = 0.45 r`` (seed 000): a head is penalised once its overlap passes 45 % of the rank."""


def par_penalty(
    wq: Tensor, wk: Tensor, rank: int | None = None, *, tau_factor: float = TAU_FACTOR, method: Method = "auto"
) -> Tensor:
    """``sum_h ReLU(sum_i c_i^2 - tau)^2`` of one layer, differentiable in ``wq`` and ``wk``.

    Args:
        wq: ``(H, d_model, d_head)`` query heads (math layout, ``split_heads``).
        wk: ``(G, d_model, d_head)`` key heads, ``H % G == 0`` (grouped-query attention: key head
            ``g`` serves query heads ``g H/G ... (g + 1) H/G - 1``, each a term of the sum). A key
            rotation may be folded in or left out: ``Wk R^T`` spans the same subspace.
        rank: ``r`` (None: ``d_head``; larger is cut to ``d_head``).
        tau_factor: ``tau = tau_factor * r``.
        method: :func:`principal_overlap`'s method.

    Returns:
        A scalar in ``[0, H (1 - tau_factor)^2 r^2]``, in ``wq``'s dtype promoted to at least
        float32. A head whose overlap is undefined (rank-deficient, dead) adds 0: PAR cannot act on
        a subspace that does not exist.
    """
    r = wq.shape[-1] if rank is None else min(rank, wq.shape[-1])
    # refine=False: a loss needs no 1e-5 accuracy, and skipping the float64 recomputation of
    # ill-conditioned heads means no host synchronisation and no graph break inside a step
    overlap = principal_overlap(wq, wk, r, method=method, refine=False)  # (H,)
    overlap = overlap.to(torch.promote_types(wq.dtype, torch.float32))
    excess = F.relu(torch.nan_to_num(overlap, nan=0.0) - tau_factor * r)
    return excess.square().sum()
