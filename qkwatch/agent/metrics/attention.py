"""Attention statistics: sampled query rows against all keys, and the spectrum of the square matrix.

``attention_stats`` builds only ``(sample x keys)`` per head: the probe hands over a few query
rows (after RoPE, as the model uses them) and the keys of the same sequence.
``attention_spectrum`` measures seed 003's quantities on a square attention matrix (the first
``W`` tokens of a sequence): ``W x W`` per head.

Which keys a row sees is the causal mask by default, or a boolean ``mask`` (``masks.visible_keys``
turns a model's attention mask, padding included, into one). Only visible keys count; a row that
sees no key at all (a padding token's query) is left out.

The logits are the ones the model softmaxes: ``q . k`` times the model's own ``scale`` (by default
``1 / sqrt(d_head)``; OPT and Whisper pre-scale their queries and pass 1, a muP model ``1 / d_head``),
soft-capped where the model caps them (Gemma 2: ``c tanh(x / c)``), plus any additive ``bias`` it
adds (ALiBi, T5's relative position bias). :func:`scored_logits` is that one formula.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkwatch.agent.metrics.heads import group_heads
from qkwatch.agent.metrics.rows import REGISTERED as ROW_METRICS
from qkwatch.agent.metrics.rows import STAT_NAMES, row_metrics
from qkwatch.agent.metrics.spectra import effective_rank


def attention_stats(
    q: Tensor,
    k: Tensor,
    causal: bool = True,
    *,
    q_pos: Tensor | None = None,
    mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
    erank: bool = True,
    scale: float | Tensor | None = None,
    softcap: float | Tensor | None = None,
    bias: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-head statistics of the softmax attention of sampled queries.

    Logits are :func:`scored_logits` (``q . k / sqrt(d_head)`` unless the model scales, caps or
    biases them otherwise); row ``i`` may see ``n_i`` keys (causal: the keys up to its
    own position, ``n_i = pos_i + 1``; otherwise all ``T_k``; with ``mask``: the keys it marks).
    Rows with ``n_i = 0`` (padding queries) are left out of every statistic; a statistic with no
    row to average is NaN.

    * ``attn_entropy``: ``H(p_i) / log(n_i)``, rows with ``n_i = 1`` skipped, mean over rows; 1 = uniform.
    * ``attn_entropy_nats``: ``H(p_i) = -sum_j p_ij log p_ij`` in nats over the same rows, mean over
      rows (seed 001's unnormalised entropy); in ``[0, log n_i]``, 0 = one-hot.
    * ``attn_top1``, ``attn_top5``, ``attn_gap``: mean largest probability, mass of the 5
      largest, ``p(1) - p(2)``.
    * ``logit_mean``, ``logit_std`` (population), ``logit_max``: over all allowed (row, key) pairs.
    * ``qk_erank``: effective rank of the singular values of the raw ``Q K^T`` on the sample.
    * every metric registered with :func:`qkwatch.agent.metrics.activation_metric`, of the same
      rows' probabilities (``agent.metrics.rows``).

    Seed 003's spectral gap and stable rank need the square attention matrix: see
    :func:`attention_spectrum`.

    Args:
        q: ``(..., T_q, d_head)`` sampled query rows.
        k: ``(..., T_k, d_head)`` all keys; ``k`` may have fewer heads than ``q`` at dim -3 (GQA).
        causal: apply the causal mask.
        q_pos: ``(T_q,)`` positions of the sampled rows among the keys; by default the last
            ``T_q`` positions (causal aligns the last ``T_q`` queries with the last ``T_q`` keys).
        dtype: compute dtype, float32 by default (float64 on request or for float64 inputs).
        erank: also ``qk_erank``, the one statistic that needs a factorisation (a Gram
            eigendecomposition per head); without it the rest is elementwise and cheap.
        scale, softcap, bias: as the model scores (:func:`scored_logits`).

    Returns:
        name -> ``(...)`` tensor, one value per head (``qk_erank`` only with ``erank``).
    """
    _check(q, k, q_pos if mask is None else None)
    dt = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    qg, kg, shape = group_heads(q.to(dt), k.to(dt))
    t_q, t_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    raw = qg @ kg.mT  # (..., Tq, Tk)
    grouped_bias = None if bias is None else _grouped(bias.to(dt), q, k, "bias")
    logits = scored_logits(raw, d, scale, softcap, grouped_bias)
    if mask is None:
        allowed, n_keys = _visible(t_q, t_k, causal, q_pos, q.device)  # (Tq, Tk), (Tq,)
    else:
        allowed = _grouped_mask(mask, q, k)  # (..., Tq, Tk), heads as in qg
        n_keys = allowed.sum(-1)
    p = _softmax(logits, allowed, n_keys)
    out = {**_row_stats(p, n_keys), **row_metrics(p, (n_keys > 0).to(p.dtype))}
    out.update(_logit_stats(logits, allowed))
    if erank:
        out["qk_erank"] = effective_rank(_singular_values(raw))
    return {name: out[name].reshape(shape) for name in (*STAT_NAMES, *ROW_METRICS) if name in out}


def qk_erank(q: Tensor, k: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
    """Effective rank of the singular values of the raw ``Q K^T`` per head (``attention_stats``'s ``qk_erank``).

    Args:
        q: ``(..., T_q, d_head)``; k: ``(..., T_k, d_head)``, fewer heads at dim -3 for GQA.

    Returns:
        ``(...)`` in ``[1, min(T_q, T_k, d_head)]``.
    """
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"qk_erank needs q (..., T_q, d_head) and k (..., T_k, d_head); got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    dt = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    qg, kg, shape = group_heads(q.to(dt), k.to(dt))
    return effective_rank(_singular_values(qg @ kg.mT)).reshape(shape)


def attention_spectrum(
    q: Tensor,
    k: Tensor,
    causal: bool = True,
    remove_outlier: bool = False,
    *,
    mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
    scale: float | Tensor | None = None,
    softcap: float | Tensor | None = None,
    bias: Tensor | None = None,
) -> dict[str, Tensor]:
    """Seed 003's stable rank and spectral gap of the square ``T x T`` attention matrix, per head.

    ``A = softmax(logits)`` (:func:`scored_logits`: ``q k^T / sqrt(d_head)`` unless the model scales,
    caps or biases otherwise) row by row (causal: row ``i`` sees keys ``j <= i``), a
    row-stochastic ``T x T`` matrix, or ``A - U`` with ``remove_outlier`` (seed 003's ``A - 1 1^T / T``
    as the model applies it: ``U_ij = 1 / n_i`` on the ``n_i`` keys row ``i`` sees, i.e.
    ``1 / (i + 1)`` for ``j <= i`` when causal, ``1 / T`` everywhere otherwise).

    * ``attn_srank``: ``||A||_F^2 / sigma_1(A)^2``, in ``[1, T]``: 1 for the uniform non-causal
      ``1 1^T / T``, ``T`` for ``A = I``.
    * ``attn_gap1``: ``sigma_1(A) - sigma_2(A)`` (``sigma_2 = 0`` when ``T = 1``), in ``[0, sqrt(T)]``
      (a row-stochastic ``A`` has ``1 <= sigma_1 <= sqrt(T)``): 1 for ``1 1^T / T``, 0 for ``I``.

    An all-zero matrix (``A = U`` exactly, with ``remove_outlier``) gives NaN for both.

    Causal attention of a prefix is a leading block: the ``W x W`` top-left block of the ``T x T``
    causal ``A`` is exactly the attention matrix of the first ``W`` tokens, so the probe passes
    the first ``W`` queries and keys of a sequence. Without the mask the first ``W`` tokens' softmax
    runs over those ``W`` keys only: the attention matrix of the ``W``-token prefix taken as a
    sequence of its own, not a block of the full one.

    With ``mask`` (``(..., H|1, T, T)`` boolean, True where a row sees a key; it replaces
    ``causal``) a row that sees no key (a padding query) is a zero row of ``A``: the spectrum is
    that of the matrix of the other rows.

    Singular values come from the ``T x T`` Gram ``A A^T``, formed in the compute dtype and
    decomposed in float64 (values below the Gram's rounding count as zero); ``||A||_F^2`` is summed
    from the entries.

    Args:
        q: ``(..., T, d_head)`` queries of one sequence (after RoPE, as the model uses them).
        k: ``(..., T, d_head)`` keys; ``k`` may have fewer heads than ``q`` at dim -3 (GQA).
        causal: apply the causal mask.
        remove_outlier: measure ``A - U`` instead of ``A``.
        dtype: compute dtype, float32 by default (float64 on request or for float64 inputs).
        scale, softcap, bias: as the model scores (:func:`scored_logits`).

    Returns:
        ``{"attn_srank", "attn_gap1"}`` -> ``(...)`` tensors, one value per head.
    """
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1] or q.shape[-2] != k.shape[-2] or q.shape[-2] < 1:
        raise ValueError(
            f"attention_spectrum needs q and k of one shape (..., T >= 1, d_head) but for GQA heads; "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    dt = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    qg, kg, shape = group_heads(q.to(dt), k.to(dt))
    t = q.shape[-2]
    grouped_bias = None if bias is None else _grouped(bias.to(dt), q, k, "bias")
    logits = scored_logits(qg @ kg.mT, q.shape[-1], scale, softcap, grouped_bias)  # (..., T, T)
    if mask is None:
        allowed, n_keys = _visible(t, t, causal, None, q.device)  # (T, T), (T,)
    else:
        allowed = _grouped_mask(mask, q, k)
        n_keys = allowed.sum(-1)
    a = _softmax(logits, allowed, n_keys).masked_fill(~allowed, 0.0)  # rows that see no key: zero
    if remove_outlier:
        a = a - allowed / n_keys.clamp_min(1).to(dt)[..., None]  # U: the uniform row over each row's visible keys
    sv = _singular_values(a)  # (..., T) descending
    fro2 = a.square().sum((-2, -1))
    second = sv[..., 1] if t > 1 else torch.zeros_like(sv[..., 0])
    out = {"attn_srank": fro2 / sv[..., 0].square(), "attn_gap1": sv[..., 0] - second}
    empty = sv[..., 0] == 0  # A = U exactly: no spectrum to speak of
    return {name: torch.where(empty, torch.full_like(v, math.nan), v).reshape(shape) for name, v in out.items()}


def scored_logits(
    raw: Tensor,
    d_head: int,
    scale: float | Tensor | None = None,
    softcap: float | Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """The logits a model softmaxes, from the raw ``q . k`` (transformers' ``eager_attention_forward``):

    ``x = raw * scale`` (``scale`` None: ``1 / sqrt(d_head)``), then ``x = softcap * tanh(x / softcap)``
    where there is a soft-cap, then ``x + bias``.

    ``scale`` and ``softcap`` are numbers, or tensors over the leading dims of ``raw`` (a value per
    layer of a stacked batch: their shape is a prefix of ``raw``'s); a soft-cap of NaN, or None, caps
    nothing. ``bias`` broadcasts against ``raw``.
    """
    x = raw * _leading(1.0 / math.sqrt(d_head) if scale is None else scale, raw)
    if softcap is not None:
        c = _leading(softcap, raw)
        capped = torch.tanh(x / c) * c
        x = torch.where(torch.isnan(c), x, capped) if isinstance(c, Tensor) else capped
    return x if bias is None else x + bias


def _leading(value: float | Tensor, like: Tensor) -> float | Tensor:
    """A number as it is; a tensor over ``like``'s leading dims, shaped to broadcast against it."""
    if not isinstance(value, Tensor):
        return value
    if like.shape[: value.ndim] != value.shape:
        raise ValueError(
            f"a scale or soft-cap of shape {tuple(value.shape)} is not over the leading dims of {tuple(like.shape)}"
        )
    return value.to(like.dtype).reshape(*value.shape, *(1,) * (like.ndim - value.ndim))


def _softmax(logits: Tensor, allowed: Tensor, n_keys: Tensor) -> Tensor:
    """Row softmax over the visible keys; a row that sees none gets a finite (uniform) row, which
    every statistic leaves out, instead of the NaN of a softmax over nothing."""
    masked = logits.masked_fill(~allowed, -math.inf).masked_fill((n_keys == 0)[..., None], 0.0)
    return torch.softmax(masked, -1)


def _row_stats(p: Tensor, n_keys: Tensor) -> dict[str, Tensor]:
    """Means over the rows that see a key (the entropies: more than one key; NaN with no such row)."""
    nats = torch.special.entr(p).sum(-1)  # -sum p log p with 0 log 0 = 0, (..., Tq)
    seen, multi = (n_keys > 0).to(p.dtype), (n_keys > 1).to(p.dtype)
    norm = n_keys.to(p.dtype).clamp_min(2).log()
    top = p.topk(min(5, p.shape[-1]), dim=-1).values  # (..., Tq, <=5)
    second = top[..., 1] if top.shape[-1] > 1 else torch.zeros_like(top[..., 0])
    return {
        "attn_entropy": _row_mean(nats / norm, multi),
        "attn_entropy_nats": _row_mean(nats, multi),
        "attn_top1": _row_mean(top[..., 0], seen),
        "attn_top5": _row_mean(top.sum(-1), seen),
        "attn_gap": _row_mean(top[..., 0] - second, seen),
    }


def _row_mean(x: Tensor, rows: Tensor) -> Tensor:
    """Mean of ``x (..., Tq)`` over the rows weighted 1 in ``rows`` (``(Tq,)`` or ``(..., Tq)``); 0/0 = NaN."""
    return (x * rows).sum(-1) / rows.sum(-1)


def _logit_stats(logits: Tensor, allowed: Tensor) -> dict[str, Tensor]:
    count = allowed.sum((-2, -1))
    mean = logits.masked_fill(~allowed, 0.0).sum((-2, -1)) / count
    centred = (logits - mean[..., None, None]).masked_fill(~allowed, 0.0)  # two passes: no cancellation
    top = logits.masked_fill(~allowed, -math.inf).amax((-2, -1))
    return {
        "logit_mean": mean,
        "logit_std": (centred.square().sum((-2, -1)) / count).sqrt(),
        "logit_max": torch.where(count > 0, top, math.nan),  # no visible key: NaN like the rest, not -inf
    }


def _singular_values(m: Tensor) -> Tensor:
    """Descending singular values of ``(..., a, b)`` through the smaller Gram, eigenvalues in float64.

    Forming the Gram in ``m``'s dtype rounds its eigenvalues by about ``sqrt(k) u lambda_1``
    (``k`` the inner dimension, ``u`` the unit roundoff); eigenvalues below four times that are
    noise and count as zero, i.e. singular values below ``2 (k u^2)^(1/4) sigma_1`` (float32, 2,048
    keys: 0.3 % of sigma_1). Effective and stable rank and the top gap are insensitive to that.
    """
    wide = m.shape[-2] <= m.shape[-1]
    gram = m @ m.mT if wide else m.mT @ m
    inner = m.shape[-1] if wide else m.shape[-2]
    evals = torch.linalg.eigvalsh(gram.double()).flip(-1)
    floor = 4 * inner**0.5 * torch.finfo(m.dtype).eps / 2 * evals[..., :1]
    evals = torch.where(evals > floor, evals, torch.zeros_like(evals))
    return evals.sqrt().to(m.dtype)


def _grouped_mask(mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """``mask (..., H|1, Tq, Tk)`` lined up with :func:`group_heads`' views of ``q`` and ``k``."""
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be boolean (..., H|1, T_q, T_k); got {mask.dtype} {tuple(mask.shape)}")
    return _grouped(mask, q, k, "mask")


def _grouped(mask: Tensor, q: Tensor, k: Tensor, what: str) -> Tensor:
    """A ``(..., H|1, Tq, Tk)`` mask or bias lined up with :func:`group_heads`' views of ``q`` and ``k``."""
    h, g = (q.shape[-3], k.shape[-3]) if q.ndim >= 3 and k.ndim >= 3 else (1, 1)
    shape_ok = mask.ndim == q.ndim and mask.shape[-2:] == (q.shape[-2], k.shape[-2])
    if not shape_ok or (q.ndim >= 3 and mask.shape[-3] not in (1, h)):
        raise ValueError(
            f"{what} must be (..., H|1, T_q, T_k) with the leading dims of q; got "
            f"{tuple(mask.shape)} for q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.ndim < 3 or h == g or g == 1:
        return mask
    if mask.shape[-3] == 1:
        return mask.unsqueeze(-3)  # (..., 1, 1, Tq, Tk) against (..., G, n_rep, Tq, Tk)
    return mask.reshape(*mask.shape[:-3], g, h // g, *mask.shape[-2:])  # (..., G, n_rep, Tq, Tk)


def _visible(t_q: int, t_k: int, causal: bool, q_pos: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor]:
    if not causal:
        return torch.ones(t_q, t_k, dtype=torch.bool, device=device), torch.full((t_q,), t_k, device=device)
    pos = torch.arange(t_k - t_q, t_k, device=device) if q_pos is None else q_pos.to(device)
    allowed = torch.arange(t_k, device=device)[None, :] <= pos[:, None]  # (Tq, Tk)
    return allowed, pos + 1


def _check(q: Tensor, k: Tensor, q_pos: Tensor | None) -> None:
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention_stats needs q (..., T_q, d_head) and k (..., T_k, d_head) with equal d_head; "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.shape[-2] < 1 or k.shape[-2] < 1:
        raise ValueError(
            f"attention_stats needs at least one query and one key; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q_pos is not None:
        if q_pos.shape != (q.shape[-2],):
            raise ValueError(f"q_pos must have shape ({q.shape[-2]},), got {tuple(q_pos.shape)}")
        # checked only on the host: on a GPU the check would cost a device synchronisation
        if q_pos.device.type == "cpu" and bool(((q_pos < 0) | (q_pos >= k.shape[-2])).any()):
            raise ValueError(f"q_pos must lie in [0, T_k={k.shape[-2]})")
    elif q.shape[-2] > k.shape[-2]:
        raise ValueError(f"more queries ({q.shape[-2]}) than keys ({k.shape[-2]}): pass q_pos")
