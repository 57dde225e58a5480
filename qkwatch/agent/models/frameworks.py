"""Training frameworks' own models: torchtitan's Llama 3, litgpt's GPT, Megatron-core's GPTModel, DeepSeek MLA.

Each adapter knows its modules by what they have (no framework is imported here) and reads the
weights and the tensors the model attends with where the framework computes them:

* torchtitan (0.3): an attention module with ``qkv_linear`` (``wq``/``wk``/``wv``, or one fused
  ``wqkv`` whose rows are grouped per KV head, ``FusedQKVLinear``) and ``inner_attention``, the
  sdpa or FlexAttention module called as ``inner_attention(q, k, v, attention_masks=..., scale=...)``
  with q and k after RoPE in ``(B, L, N, H)``. A FlexAttention ``BlockMask`` is read exactly (its
  ``mask_mod`` evaluated on every query/key pair, on report steps only): causal and packed documents.
* litgpt (0.5): ``CausalSelfAttention`` with a fused ``qkv`` whose rows are ``[q; k; v]``
  (``config.n_head`` query heads, ``config.n_query_groups`` key heads), and its
  ``scaled_dot_product_attention(q, k, v, mask)`` method, called after RoPE (and after the keys are
  repeated per query head; the tap takes one key per group back). Its scale
  (``attention_scores_scalar``, YaRN's ``mscale``) and soft-cap are the model's own.
* Megatron-core (0.16): ``SelfAttention`` with ``linear_qkv`` grouped per KV head
  (``[q_0 .. q_{r-1}; k; v]`` per query group) and ``core_attention`` called with query and key
  after RoPE, ``[s, b, h, d]``, and Megatron's boolean mask (True: hidden).
* DeepSeek MLA (transformers' ``DeepseekV3Attention``, DeepSeek-V2/V3): the per-head bilinear
  form of the compressed projections, ``Wq_h = W_qa^T diag(g_q) W_qb,h^T`` (or ``q_proj``'s) against
  ``Wk_h = [W_kva,nope^T diag(g_kv) W_kb,h^T | W_kva,rope^T]``: each head's last ``qk_rope_head_dim``
  columns are the decoupled RoPE part, one key shared by every head. The RMSNorms on the two
  latents also divide each token by its latent's RMS: a positive per-token factor the weights
  cannot hold (it moves no column space). Activations come from the model's attention function,
  as for every transformers model (``agent.models.hf_taps``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from qkwatch.agent.metrics import split_heads
from qkwatch.agent.models.hf_models import configs_by_path
from qkwatch.agent.models.hf_taps import install_attention_tap
from qkwatch.agent.models.qk_norm import with_qk_norm
from qkwatch.agent.models.sites import (
    AdapterError,
    Projections,
    Scoring,
    Site,
    TapFn,
    is_projection,
    numbered,
    projection_site,
    wanted,
    weight_of,
)

logger = logging.getLogger(__name__)

__all__ = ["deepseek_mla", "litgpt", "megatron", "torchtitan"]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _pre_hook(module: nn.Module, fn: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> Callable[[], None]:
    """A forward pre-hook that hands ``fn`` the call's arguments and keyword arguments; only reads."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn(args, kwargs)

    return module.register_forward_pre_hook(hook, with_kwargs=True).remove


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


# --- torchtitan --------------------------------------------------------------------------------


def torchtitan(model: nn.Module) -> list[Site]:
    """torchtitan's ``GQAttention`` (Llama 3, Qwen 3): ``qkv_linear`` and ``inner_attention``."""
    sites: list[Site] = []
    for name, module in numbered(model):
        qkv_linear, inner = getattr(module, "qkv_linear", None), getattr(module, "inner_attention", None)
        h, g, hs = (_int(getattr(module, a, None)) for a in ("n_heads", "n_kv_heads", "head_dim"))
        if not isinstance(qkv_linear, nn.Module) or not isinstance(inner, nn.Module) or not (h and g and hs):
            continue
        wqkv, wq, wk = (getattr(qkv_linear, a, None) for a in ("wqkv", "wq", "wk"))
        if isinstance(wqkv, nn.Module):
            projections = Projections(qkv=wqkv, split="per_kv_head")  # FusedQKVLinear: [q group; k; v] per KV head
        elif is_projection(wq) and is_projection(wk):
            projections = Projections(q=wq, k=wk)
        else:
            raise AdapterError(
                f"pass layout=qkwatch.Layout naming {name}.qkv_linear's query and key projections, n_heads={h}, "
                f"n_kv_heads={g}: its {type(qkv_linear).__name__} has neither wqkv nor wq and wk"
            )
        install = partial(_titan_tap, inner)
        site = projection_site(len(sites), name, module, projections, h, g, d_head=hs, install_tap=install)
        sites.append(with_qk_norm(site, module, "q_norm", "k_norm"))
    return sites


def _titan_tap(inner: nn.Module, fn: TapFn) -> Callable[[], None]:
    asked = wanted(fn)

    def tap(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) < 2 or not asked():
            return
        q, k = args[0].transpose(1, 2), args[1].transpose(1, 2)  # (B, L, N, H) -> (B, N, L, H)
        masks = kwargs.get("attention_masks")
        causal = bool(kwargs.get("is_causal", True))
        mask: Tensor | None = None
        if masks is not None:
            mask, causal = _block_mask(masks, q, k)
        if kwargs.get("score_mod") is not None:
            _warn_once(
                "titan-score", "qkwatch cannot read torchtitan's FlexAttention score_mod: logits read unmodified"
            )
        scale = kwargs.get("scale")
        fn(q, k, mask, causal, Scoring(float(scale)) if isinstance(scale, (int, float)) else None)

    return _pre_hook(inner, tap)


def _block_mask(masks: Any, q: Tensor, k: Tensor) -> tuple[Tensor | None, bool]:
    """A FlexAttention ``BlockMask`` as the boolean mask it stands for (its ``mask_mod`` on every
    query/key pair: exact, where the blocks alone are not); anything else (varlen metadata) is not
    read, and the causal mask is assumed."""
    mask_mod = getattr(masks, "mask_mod", None)
    shape = getattr(masks, "shape", None)
    if mask_mod is None or shape is None:
        _warn_once(
            "titan-mask",
            f"qkwatch cannot read torchtitan's {type(masks).__name__}: attention statistics assume the causal mask "
            "and see keys across packed documents",
        )
        return None, True
    from torch.nn.attention.flex_attention import create_mask

    b, h = int(shape[0]), int(shape[1])
    return create_mask(mask_mod, b, h, q.shape[-2], k.shape[-2], device=q.device), False


# --- litgpt ------------------------------------------------------------------------------------


def litgpt(model: nn.Module) -> list[Site]:
    """litgpt's ``CausalSelfAttention``: fused ``qkv`` as ``[q; k; v]``, tapped at its
    ``scaled_dot_product_attention``."""
    sites: list[Site] = []
    for name, module in numbered(model):
        qkv, config = getattr(module, "qkv", None), getattr(module, "config", None)
        sdpa = getattr(module, "scaled_dot_product_attention", None)
        h = _int(getattr(config, "n_head", None))
        g = _int(getattr(config, "n_query_groups", None))
        hs = _int(getattr(config, "head_size", None))
        if not is_projection(qkv) or not callable(sdpa) or not (h and g and hs):
            continue
        assert isinstance(qkv, nn.Module)
        install = partial(_litgpt_tap, module, config, h, g)
        site = projection_site(len(sites), name, module, Projections(qkv=qkv), h, g, d_head=hs, install_tap=install)
        sites.append(with_qk_norm(site, module, "norm_q", "norm_k"))
    return sites


def _litgpt_tap(module: nn.Module, config: Any, h: int, g: int, fn: TapFn) -> Callable[[], None]:
    """Wraps the module's own ``scaled_dot_product_attention`` (an instance attribute, removed again)."""
    original: Callable[..., Tensor] = module.scaled_dot_product_attention  # type: ignore[assignment]
    asked = wanted(fn)
    scalar = getattr(config, "attention_scores_scalar", None) or config.head_size
    mscale = float(getattr(module, "mscale", 1.0))
    softcap = getattr(config, "attention_logit_softcapping", None)
    scoring = Scoring(mscale * mscale / math.sqrt(scalar), float(softcap) if softcap else None)

    def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if asked():
            keys = k[:, :: h // g] if k.shape[1] == h != g else k  # repeated per query head: one per group
            fn(q, keys, mask, mask is None, scoring)
        return original(q, k, v, mask)

    module.__dict__["scaled_dot_product_attention"] = attention  # an instance attribute: found before the method

    def remove() -> None:
        if module.__dict__.get("scaled_dot_product_attention") is attention:
            del module.__dict__["scaled_dot_product_attention"]

    return remove


# --- Megatron-core ------------------------------------------------------------------------------


def megatron(model: nn.Module) -> list[Site]:
    """Megatron-core's ``SelfAttention``: ``linear_qkv`` grouped per KV head, tapped at ``core_attention``."""
    sites: list[Site] = []
    for name, module in numbered(model):
        linear_qkv, core = getattr(module, "linear_qkv", None), getattr(module, "core_attention", None)
        h = _int(getattr(module, "num_attention_heads_per_partition", None))
        g = _int(getattr(module, "num_query_groups_per_partition", None))
        hs = _int(getattr(module, "hidden_size_per_attention_head", None))
        if not isinstance(linear_qkv, nn.Module) or not isinstance(core, nn.Module) or not (h and g and hs):
            continue
        config = getattr(module, "config", None)
        if getattr(config, "attention_output_gate", False):
            raise AdapterError(
                f"set attention_output_gate=False to monitor {name}: qkwatch does not split its gated linear_qkv "
                f"({h // g} q, {h // g} gate, 1 k and 1 v heads of {hs} per query group, {g} groups)"
            )
        projections = Projections(qkv=linear_qkv, split="per_kv_head")
        install = partial(_megatron_tap, core)
        site = projection_site(len(sites), name, module, projections, h, g, d_head=hs, install_tap=install)
        sites.append(with_qk_norm(site, module, "q_layernorm", "k_layernorm"))
    return sites


def _megatron_tap(core: nn.Module, fn: TapFn) -> Callable[[], None]:
    asked = wanted(fn)

    def tap(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) < 2 or not asked():
            return
        query, key = args[0], args[1]
        if query.ndim != 4:
            _warn_once("megatron-thd", "qkwatch cannot read Megatron's packed (thd) sequences: layer not measured")
            return
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        kind = kwargs.get("attn_mask_type") or getattr(core, "attn_mask_type", None)
        tap_mask, causal = _megatron_visibility(core, mask, str(getattr(kind, "name", kind)))
        fn(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), tap_mask, causal, _megatron_scoring(core))

    return _pre_hook(core, tap)


def _megatron_visibility(core: nn.Module, mask: Any, kind: str) -> tuple[Tensor | None, bool]:
    """Megatron's masks are True where a key is hidden. Its own ``DotProductAttention`` applies a
    given mask alone and the causal mask only when none is given; Transformer Engine's causal types
    apply the causal mask and, with padding, the mask too."""
    given = None
    if isinstance(mask, Tensor):
        given = ~mask if mask.dtype == torch.bool else mask
    if hasattr(core, "scale_mask_softmax"):  # megatron.core's own DotProductAttention
        return (given, False) if given is not None else (None, "causal" in kind)
    return (given if "padding" in kind or "arbitrary" in kind else None), "causal" in kind


def _megatron_scoring(core: nn.Module) -> Scoring | None:
    scale = getattr(core, "softmax_scale", None)
    if not isinstance(scale, (int, float)):
        return None
    coeff = getattr(getattr(core, "scale_mask_softmax", None), "scale", None)  # apply_query_key_layer_scaling
    return Scoring(float(scale) * (float(coeff) if isinstance(coeff, (int, float)) else 1.0))


# --- DeepSeek MLA (transformers) ---------------------------------------------------------------


def deepseek_mla(model: nn.Module) -> list[Site]:
    """transformers' multi-head latent attention (``DeepseekV3Attention``, DeepSeek-V2's): the
    effective per-head query and key factors of the compressed projections."""
    configs = configs_by_path(model)
    sites: list[Site] = []
    for name, module in numbered(model):
        config = configs.get(name)
        kv_a, kv_b = getattr(module, "kv_a_proj_with_mqa", None), getattr(module, "kv_b_proj", None)
        h = _int(getattr(module, "num_heads", None))
        nope, rope = _int(getattr(module, "qk_nope_head_dim", None)), _int(getattr(module, "qk_rope_head_dim", None))
        if config is None or not is_projection(kv_a) or not is_projection(kv_b) or not (h and nope and rope):
            continue
        sites.append(
            Site(
                layer=len(sites),
                name=name,
                module=module,
                n_heads=h,
                n_kv_heads=h,  # one key per head: its own no-RoPE part, the shared RoPE part
                d_head=nope + rope,
                causal=bool(getattr(module, "is_causal", True)),
                weights=partial(_mla_weights, module, name, h, nope, rope),
                install_tap=partial(install_attention_tap, config, module),
            )
        )
    return sites


def _mla_weights(module: nn.Module, name: str, h: int, nope: int, rope: int) -> tuple[Tensor, Tensor, None]:
    """``wq (H, D, nope + rope)`` and ``wk (H, D, nope + rope)``, the last ``rope`` columns the RoPE part."""
    q_proj = getattr(module, "q_proj", None)
    if is_projection(q_proj):
        assert isinstance(q_proj, nn.Module)
        wq = weight_of(q_proj)  # (H (nope + rope), D)
    else:
        q_a, q_b, q_norm = (getattr(module, a, None) for a in ("q_a_proj", "q_b_proj", "q_a_layernorm"))
        if not (is_projection(q_a) and is_projection(q_b)):
            raise AdapterError(f"qkwatch reads {name}'s queries from q_proj or q_a_proj and q_b_proj; it has neither")
        assert isinstance(q_a, nn.Module) and isinstance(q_b, nn.Module)
        wq = (weight_of(q_b) * _norm_weight(q_norm)) @ weight_of(q_a)  # W_qb diag(g) W_qa
    kv_a, kv_b = weight_of(module.kv_a_proj_with_mqa), weight_of(module.kv_b_proj)  # type: ignore[arg-type]
    latent = kv_a.shape[0] - rope
    k_latent, k_rope = kv_a[:latent], kv_a[latent:]  # (latent, D), (rope, D): compressed_kv's split
    kv_b = (kv_b * _norm_weight(getattr(module, "kv_a_layernorm", None))).view(h, -1, latent)  # (H, nope + v, latent)
    k_nope = kv_b[:, :nope] @ k_latent  # (H, nope, D)
    wk = torch.cat([k_nope, k_rope.expand(h, rope, k_rope.shape[-1])], dim=1)  # (H, nope + rope, D)
    return split_heads(wq, h), wk.transpose(-1, -2), None


def _norm_weight(norm: object) -> Tensor | float:
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, Tensor) else 1.0
