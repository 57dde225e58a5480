"""HuggingFace ``transformers`` models: where their attention is (the tap is ``agent.models.hf_taps``).

Every transformers model of the ``AttentionInterface`` era (Llama, Mistral, Qwen2/3 with GQA and
RoPE; BERT; GPT-2 with its fused ``Conv1D``) computes q and k in the attention module's forward
(RoPE applied) and hands them, with the mask it built, to an attention function it looks up at
call time. An attention module counts when it, or a module above it, carries a transformers
config; its projections (separate, or fused in a row order this module knows per architecture)
and head counts come from the module and its config. Each layer is tapped by wrapping that
function under its own name (``agent.models.hf_taps``), or, for Bloom, which attends inline, by
hooks on its fused projection.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from qkwatch.agent.models.hf_taps import install_attention_tap, install_bloom_tap
from qkwatch.agent.models.qk_norm import with_qk_norm
from qkwatch.agent.models.sites import Projections, Site, is_projection, numbered, projection_site
from qkwatch.agent.models.unknown import CROSS


def find(model: nn.Module) -> list[Site]:
    """Every attention layer of the transformers models in ``model``, in order.

    ``model`` may be a transformers model itself, an encoder-decoder (each self-attention stack's
    layers, by path; cross-attention is left out), or hold one anywhere inside it (a LightningModule's
    ``self.model``, DDP's ``.module``, ``torch.compile``'s ``_orig_mod``, PEFT's base model, or
    several models side by side): an attention module counts when it, or a module above it, carries
    a transformers config (``config._attn_implementation``). Each site is named by its path in ``model``.
    """
    configs = configs_by_path(model)
    sites: list[Site] = []
    for name, module in numbered(model):
        config = configs.get(name)
        cross = CROSS.search(name.rsplit(".", 1)[-1]) is not None
        projections = _projections(module, config) if config is not None and not cross else None
        if config is None or projections is None:
            continue
        heads = _heads(module, config)
        if heads is None:
            continue
        n_heads, n_kv, d_head = heads
        causal = bool(getattr(module, "is_causal", True))
        if _model_type(config) == "bloom":
            install = partial(install_bloom_tap, module, projections, n_heads)
        else:
            install = partial(install_attention_tap, config, module)
        site = projection_site(
            len(sites), name, module, projections, n_heads, n_kv, d_head=d_head, causal=causal, install_tap=install
        )
        sites.append(with_qk_norm(site, module, "q_norm", "k_norm"))
    return sites


def configs_by_path(model: nn.Module) -> dict[str, Any]:
    """Module path -> the transformers config that governs it: its own, else the nearest above it."""
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        own = getattr(module, "config", None)
        if own is not None and hasattr(own, "_attn_implementation"):
            out[name] = own
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name and parent in out:
            out[name] = out[parent]
    return out


def _heads(module: nn.Module, config: Any) -> tuple[int, int, int | None] | None:
    """``(n_heads, n_kv_heads, d_head)`` of one attention module: its own attributes first (a model
    with several stacks has different counts in each), then its config's; None when neither says."""
    n_heads = _attr(module, "num_heads", "num_attention_heads", "n_head") or _cfg(
        config, "num_attention_heads", "n_head"
    )
    if not n_heads:
        return None
    groups = _attr(module, "num_key_value_groups")
    n_kv = n_heads // groups if groups else _cfg(config, "num_key_value_heads") or n_heads
    width = _cfg(config, "hidden_size", "n_embd")
    d_head = (
        _attr(module, "head_dim", "attention_head_size")
        or _cfg(config, "head_dim")
        or (width // n_heads if width else None)  # None: the weights' head size
    )
    return n_heads, n_kv, d_head


def _attr(module: nn.Module, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


FUSED_SPLITS: dict[str, str] = {
    "gpt_neox": "per_head",  # query_key_value viewed (..., H, 3 hs)
    "bloom": "per_head",  # query_key_value viewed (..., H, 3, hs)
    "phi3": "qkv",  # qkv_proj: [q; k; v] with GQA
    "modernbert": "qkv",  # Wqkv viewed (..., 3, H, hs)
    "gpt2": "qkv",  # c_attn, a Conv1D
}
"""How each architecture with a fused QKV projection orders its rows (``agent.metrics.SPLITS``), read off
its modeling code; Falcon and GPT-BigCode depend on their config (:func:`_fused_split`). A fused
projection of any other architecture is not guessed at: the module is skipped, and named."""

FUSED_NAMES = ("query_key_value", "qkv_proj", "Wqkv", "c_attn")


def _projections(module: nn.Module, config: Any) -> Projections | None:
    for q, k in (("q_proj", "k_proj"), ("query", "key"), ("q", "k")):
        q_mod, k_mod = getattr(module, q, None), getattr(module, k, None)
        if is_projection(q_mod) and is_projection(k_mod):
            return Projections(q=q_mod, k=k_mod)
    if getattr(module, "is_cross_attention", False):
        return None
    for name in FUSED_NAMES:
        fused = getattr(module, name, None)
        if fused is None:
            continue
        conv1d = type(fused).__name__ == "Conv1D"
        if not (conv1d or is_projection(fused)):
            return None
        split = _fused_split(module, config, conv1d)
        return None if split is None else Projections(qkv=fused, conv1d=conv1d, split=split)
    return None


def _fused_split(module: nn.Module, config: Any, conv1d: bool) -> str | None:
    """The row order of ``module``'s fused projection, or None where qkwatch does not know it."""
    kind = _model_type(config)
    if conv1d:
        return "qkv"  # GPT-2's Conv1D c_attn and its descendants
    if kind == "falcon":
        if getattr(module, "new_decoder_architecture", False):
            return "per_kv_head"  # (..., G, H/G + 2, hs): each group's queries, then its key and value
        return "qkv" if getattr(module, "multi_query", False) else "per_head"
    if kind == "gpt_bigcode":
        return "qkv" if getattr(module, "multi_query", False) else "per_head"
    return FUSED_SPLITS.get(kind)


def _model_type(config: Any) -> str:
    kind = getattr(config, "model_type", "")
    return kind if isinstance(kind, str) else ""


def _cfg(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
