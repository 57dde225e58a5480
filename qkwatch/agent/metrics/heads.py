"""From projection weights to per-head factors in math layout.

Math layout (docs/metrics.md): for one head, ``Wq_h`` and ``Wk_h`` are ``d_model x d_head``; their
columns span the head's query / key subspace of the residual stream.
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_heads(weight: Tensor, n_heads: int) -> Tensor:
    """Per-head factors of an ``nn.Linear(d_model, n_heads * d_head)`` weight.

    Args:
        weight: ``(..., n_heads * d_head, d_model)``, the layout of ``nn.Linear.weight``.
        n_heads: number of heads the output features are split into.

    Returns:
        ``(..., n_heads, d_model, d_head)``.
    """
    if weight.ndim < 2:
        raise ValueError(f"split_heads expects (..., n_heads*d_head, d_model), got shape {tuple(weight.shape)}")
    out_features, d_model = weight.shape[-2:]
    if n_heads <= 0 or out_features % n_heads:
        raise ValueError(
            f"split_heads: {out_features} output features do not split into {n_heads} heads "
            f"(weight shape {tuple(weight.shape)})"
        )
    d_head = out_features // n_heads
    heads = weight.reshape(*weight.shape[:-2], n_heads, d_head, d_model)  # (..., nh, hs, D)
    return heads.transpose(-1, -2)  # (..., nh, D, hs)


SPLITS = ("qkv", "per_head", "per_kv_head")
"""How a fused QKV projection orders its output rows (``split_qkv``'s ``split``):

* ``"qkv"``: ``[q; k; v]``, each block its heads in order (nanoGPT, GPT-2, Phi-3's ``qkv_proj``,
  ModernBERT's ``Wqkv``, multi-query Falcon and GPT-BigCode, where k and v are one head each);
* ``"per_head"``: ``[q_0; k_0; v_0; q_1; ...]``, one head at a time (GPT-NeoX/Pythia, Bloom, the
  first Falcon, GPT-BigCode without multi-query); needs as many key heads as query heads;
* ``"per_kv_head"``: per key/value head, its group of query heads then its key and value
  (``[q_0 .. q_{r-1}; k_0; v_0; q_r ...]``, r = n_heads / n_kv_heads: Falcon's
  ``new_decoder_architecture``, Megatron-core's ``linear_qkv``).
"""


def split_qkv(
    weight: Tensor,
    n_heads: int,
    n_kv_heads: int | None = None,
    *,
    conv1d: bool = False,
    split: str = "qkv",
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-head query, key and value factors of a fused QKV projection.

    nanoGPT's ``c_attn`` is an ``nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * d_head)`` whose
    output rows are ``[q; k; v]``. GPT-2's ``Conv1D`` stores the same matrix transposed,
    ``(d_model, 3 * d_model)``: pass ``conv1d=True``. Other models order the rows per head or per
    key/value head: ``split`` names the order (:data:`SPLITS`).

    Returns:
        ``wq (..., n_heads, d_model, d_head)``, ``wk`` and ``wv`` ``(..., n_kv_heads, d_model, d_head)``.
    """
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if split not in SPLITS:
        raise ValueError(f"split_qkv: split={split!r} is none of {', '.join(SPLITS)}")
    if weight.ndim < 2:
        raise ValueError(f"split_qkv expects a matrix, got shape {tuple(weight.shape)}")
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(f"split_qkv: {n_heads} query heads do not group over {n_kv_heads} key/value heads")
    if split == "per_head" and n_kv_heads != n_heads:
        raise ValueError(
            f"split_qkv: split='per_head' needs as many key/value heads as query heads, not {n_kv_heads} of {n_heads}"
        )
    linear = weight.transpose(-1, -2) if conv1d else weight  # (..., (nh + 2 nkv) hs, D)
    rows, d_model = linear.shape[-2:]
    total_heads = n_heads + 2 * n_kv_heads
    if rows % total_heads:
        layout = "Conv1D (d_model, 3*d_model)" if conv1d else "Linear (3*d_model, d_model)"
        raise ValueError(
            f"split_qkv: fused weight of shape {tuple(weight.shape)} ({layout}) does not split into "
            f"{n_heads} query + 2 x {n_kv_heads} key/value heads"
        )
    d_head = rows // total_heads
    lead = linear.shape[:-2]
    if split == "qkv":
        wq, wk, wv = torch.split(linear, [n_heads * d_head, n_kv_heads * d_head, n_kv_heads * d_head], dim=-2)
        return split_heads(wq, n_heads), split_heads(wk, n_kv_heads), split_heads(wv, n_kv_heads)
    ratio = n_heads // n_kv_heads
    grouped = linear.reshape(*lead, n_kv_heads, ratio + 2, d_head, d_model)  # per_head: ratio == 1
    wq = grouped[..., :ratio, :, :].reshape(*lead, n_heads, d_head, d_model)
    wk, wv = grouped[..., ratio, :, :], grouped[..., ratio + 1, :, :]
    return wq.transpose(-1, -2), wk.transpose(-1, -2), wv.transpose(-1, -2)


def split_qkv_output(out: Tensor, n_heads: int, n_kv_heads: int, *, split: str = "qkv") -> tuple[Tensor, Tensor]:
    """Queries ``(B, n_heads, T, d_head)`` and keys ``(B, n_kv_heads, T, d_head)`` out of a fused
    projection's output ``(B, T, (n_heads + 2 n_kv_heads) d_head)``, its features ordered as
    :func:`split_qkv`'s ``split`` says."""
    b, t, width = out.shape
    total = n_heads + 2 * n_kv_heads
    if width % total:
        raise ValueError(f"fused output of width {width} does not split into {n_heads} + 2 x {n_kv_heads} heads")
    hs = width // total
    if split == "qkv":
        q, k, _ = torch.split(out, [n_heads * hs, n_kv_heads * hs, n_kv_heads * hs], dim=-1)
        return q.view(b, t, n_heads, hs).transpose(1, 2), k.view(b, t, n_kv_heads, hs).transpose(1, 2)
    ratio = n_heads // n_kv_heads
    grouped = out.view(b, t, n_kv_heads, ratio + 2, hs)
    q = grouped[:, :, :, :ratio].reshape(b, t, n_heads, hs)
    return q.transpose(1, 2), grouped[:, :, :, ratio].transpose(1, 2)


def householder(vectors: Tensor) -> Tensor:
    """Product of Householder reflections ``H_1 H_2 ... H_p``, ``H_i = I - 2 v_i v_i^T / |v_i|^2``.

    Args:
        vectors: ``(..., p, d)``; each row one reflection vector (nonzero).

    Returns:
        ``(..., d, d)`` orthogonal matrices. Applied to a key ``k`` (column) as ``R @ k``.
    """
    *lead, p, d = vectors.shape
    eye = torch.eye(d, dtype=vectors.dtype, device=vectors.device)
    rot = eye.expand(*lead, d, d)
    for i in range(p):  # p is small (4 in seed 000); the loop is over reflections, not heads
        v = vectors[..., i, :].unsqueeze(-1)  # (..., d, 1)
        reflect = eye - 2.0 * (v @ v.mT) / (v.mT @ v)  # (..., d, d)
        rot = rot @ reflect
    return rot


def effective_key_map(wk: Tensor, rotation: Tensor | None) -> Tensor:
    """The key map the bilinear form actually uses, ``Wk_h R_h^T``.

    A model that rotates keys after projection (``k' = R_h k``, RAA's Householder rotation) has
    logits ``q^T R_h k = x^T Wq_h R_h Wk_h^T y``.

    Args:
        wk: ``(..., d_model, d_head)``.
        rotation: ``(..., d_head, d_head)`` or None (no rotation).
    """
    if rotation is None:
        return wk
    if rotation.shape[-2:] != (wk.shape[-1], wk.shape[-1]):
        raise ValueError(
            f"key rotation of shape {tuple(rotation.shape)} does not fit key heads of shape {tuple(wk.shape)}"
        )
    return wk @ rotation.mT


def group_heads(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """Line query heads up with the key head that serves them, without copying keys.

    With grouped-query attention key head ``g`` serves query heads ``g*n_rep ... (g+1)*n_rep-1``.
    Both tensors carry heads at dim -3. When the head counts differ, ``q`` is viewed as
    ``(..., G, n_rep, a, b)`` and ``k`` as ``(..., G, 1, a', b')`` so that broadcasting does the
    expansion. Returns the two views and the shape to reshape a per-head result to.
    """
    if q.ndim < 3 or k.ndim < 3:
        # no head dim: plain broadcasting
        return q, k, tuple(_broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    h, g = q.shape[-3], k.shape[-3]
    if h == g or g == 1:
        try:
            lead = _broadcast_shapes(q.shape[:-2], k.shape[:-2])
        except RuntimeError:
            raise ValueError(f"query shape {tuple(q.shape)} and key shape {tuple(k.shape)} do not broadcast") from None
        return q, k, tuple(lead)
    if h % g:
        raise ValueError(
            f"{h} query heads cannot share {g} key heads (grouped-query attention needs "
            f"n_heads % n_kv_heads == 0); query shape {tuple(q.shape)}, key shape {tuple(k.shape)}"
        )
    try:
        lead = _broadcast_shapes(q.shape[:-3], k.shape[:-3])
    except RuntimeError:
        raise ValueError(f"query shape {tuple(q.shape)} and key shape {tuple(k.shape)} do not broadcast") from None
    qg = q.reshape(*q.shape[:-3], g, h // g, *q.shape[-2:])  # (..., G, n_rep, a, b)
    kg = k.unsqueeze(-3)  # (..., G, 1, a', b')
    return qg, kg, (*lead, h)


def _broadcast_shapes(a: torch.Size, b: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes(a, b)``; RuntimeError when they do not broadcast."""
    if a == b:  # the common case, without torch.broadcast_shapes' cost (tens of microseconds)
        return a
    shape: torch.Size = torch.broadcast_shapes(a, b)  # type: ignore[no-untyped-call]  # unannotated in torch
    return shape
