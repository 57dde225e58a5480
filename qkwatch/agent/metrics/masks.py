"""Attention masks as the metrics read them: which keys each query row sees, and the bias an additive mask adds.

``mask`` follows PyTorch's and transformers' conventions (boolean, additive float, integer key
padding); :func:`visible_keys` turns any of them into one boolean shape, :func:`mask_values` keeps
an additive mask's finite values (ALiBi, a position bias) as the bias the model adds to its logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


def visible_keys(mask: Tensor | None, causal: bool, t_q: int, t_k: int) -> Tensor | None:
    """The keys each query row sees, from the mask a model's attention was given.

    ``mask`` follows PyTorch's and transformers' conventions: boolean (True: the key takes part),
    additive float (0 for a visible key, the dtype's minimum or ``-inf`` for a hidden one; anything
    above half the minimum counts as visible), or integer ``(B, T_k)`` key padding (1: a real
    token). Its last dim may run past ``T_k`` (a cache's length): only the first ``T_k`` keys count,
    as in transformers' eager attention. With ``causal`` the causal mask is applied on top,
    aligning the last ``T_q`` queries with the last ``T_k`` keys.

    Args:
        mask: ``(B, T_k)``, ``(B, T_q, T_k)`` or ``(B, H|1, T_q|1, T_k)``, or None.
        causal: apply the causal mask too.
        t_q, t_k: the numbers of queries and keys attended.

    Returns:
        ``(B|1, H|1, T_q, T_k)`` boolean, or None when there is no mask (``causal`` alone then says
        which keys are seen).
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        seen = mask
    elif mask.is_floating_point():
        seen = mask > torch.finfo(mask.dtype).min / 2
    else:
        seen = mask != 0
    if seen.ndim == 2:
        seen = seen[:, None, None, :]  # (B, 1, 1, Tk): key padding
    elif seen.ndim == 3:
        seen = seen[:, None]  # (B, 1, Tq, Tk)
    if seen.ndim != 4 or seen.shape[-1] < t_k or seen.shape[-2] not in (1, t_q):
        raise ValueError(
            f"an attention mask for {t_q} queries and {t_k} keys must be (B, T_k), (B, T_q, T_k) or "
            f"(B, H, T_q, T_k); got {tuple(mask.shape)}"
        )
    seen = seen[..., :t_k].expand(*seen.shape[:2], t_q, t_k)
    if causal:
        rows = torch.arange(t_k - t_q, t_k, device=seen.device)[:, None]
        seen = seen & (torch.arange(t_k, device=seen.device)[None, :] <= rows)  # (Tq, Tk)
    return seen


def mask_values(mask: Tensor, t_q: int, t_k: int) -> Tensor:
    """The finite values of an additive mask, the bias a model adds to its logits (ALiBi, a position
    bias), as ``(B|1, H|1, T_q, T_k)`` float32 with its hidden keys at 0. A boolean or integer mask
    adds nothing: zeros. ``mask`` takes :func:`visible_keys`' shapes."""
    m = mask.float() if mask.is_floating_point() else torch.zeros(mask.shape, device=mask.device)
    if m.ndim == 2:
        m = m[:, None, None, :]
    elif m.ndim == 3:
        m = m[:, None]
    m = m[..., :t_k].expand(*m.shape[:2], t_q, t_k)
    return m.masked_fill(m <= torch.finfo(m.dtype).min / 2, 0.0)
