"""When the adapters do not know a model: what it holds, and the one line that names its layout.

:func:`suggest_layout` looks for the projections an attention layer is made of, under the names
people give them (``q``/``k``, ``q_proj``, ``query``, ``to_q``, ``wq``; fused ``qkv``, ``Wqkv``,
``query_key_value``, ``in_proj``), finds the part of their path that counts the layers, and writes
the ``layout=qkwatch.Layout(...)`` that :func:`qkwatch.agent.models.adapters.find_sites` then follows.
:func:`skipped` names the attention-looking modules a finder did not turn into a layer, so that
attaching never monitors some layers and silently not the others.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from qkwatch.agent.models.sites import Site

QUERY = ("q_proj", "query", "to_q", "wq", "q_lin", "query_proj", "q")
KEY = ("k_proj", "key", "to_k", "wk", "k_lin", "key_proj", "k")
FUSED = {
    "qkv": "qkv",
    "qkv_proj": "qkv",
    "Wqkv": "qkv",
    "in_proj": "qkv",
    "to_qkv": "qkv",
    "c_attn": "qkv",
    "att_proj": "qkv",
    "query_key_value": "per_head",
    "wqkv": "per_kv_head",
    "linear_qkv": "per_kv_head",
}
"""Fused projections by name, with the row order that name usually has (GPT-NeoX's ``query_key_value``
is per head; Megatron's ``linear_qkv`` and torchtitan's ``wqkv`` per key/value head); the line says so."""
HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead")
KV_COUNTS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head", "num_query_groups", "n_query_groups")
INNER = ("inner_attention", "core_attention", "attn_fn", "attention_fn", "sdpa", "attn_op", "qk_tap")
"""Names of a module called with q and k after RoPE, when a model has one (torchtitan, Megatron-core)."""
ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
CROSS = re.compile(r"^(encoder_attn|crossattention|cross_attn|EncDecAttention)$")
"""Cross-attention modules (BART's, Whisper's, T5's, GPT-2's with ``add_cross_attention``): queries from one
sequence, keys from another, so a query has no key of its own to tell padding by; left out, and named
among the skipped modules as cross-attention."""
ROTARY = re.compile(r"rotary|rope", re.IGNORECASE)


def suggest_layout(model: nn.Module) -> str | None:
    """``layout=qkwatch.Layout(...)`` for the attention projections found in ``model``, or None: the
    real module paths, the head counts the model's modules or config hold, ``causal=False`` for an
    attention that says it is not causal, and ``tap=`` (or ``activations=False``) for a rotary model."""
    linears = {name: m for name, m in model.named_modules() if _linear(m)}
    for fused, split in FUSED.items():
        found = [n for n in linears if n.rsplit(".", 1)[-1] == fused]
        pattern = _pattern(found)
        if pattern:
            return _line(model, found[0], pattern, f"qkv={pattern!r}, split={split!r}")
    for q_name, k_name in zip(QUERY, KEY, strict=True):
        qs = [n for n in linears if n.rsplit(".", 1)[-1] == q_name]
        ks = {n for n in linears if n.rsplit(".", 1)[-1] == k_name}
        pairs = [q for q in qs if _sibling(q, k_name) in ks]
        pattern = _pattern(pairs)
        if pattern:
            return _line(model, pairs[0], pattern, f"q={pattern!r}, k={_sibling(pattern, k_name)!r}")
    return None


def _line(model: nn.Module, projection: str, pattern: str, where: str) -> str:
    """The line for layer paths ``pattern`` (``projection`` its layer-0 path)."""
    owner = model.get_submodule(projection.rsplit(".", 1)[0]) if "." in projection else model
    n_heads, n_kv = _count(model, owner, HEAD_COUNTS), _count(model, owner, KV_COUNTS)
    parts = [where, f"n_heads={n_heads}" if n_heads else "n_heads=<its head count: none found on the model>"]
    if n_kv and n_kv != n_heads:
        parts.append(f"n_kv_heads={n_kv}")
    if getattr(owner, "is_causal", None) is False:
        parts.append("causal=False")
    if rotary_module(model):
        inner = next((name for name in INNER if isinstance(getattr(owner, name, None), nn.Module)), None)
        owner_pattern = pattern.rsplit(".", 1)[0]
        parts.append(f"tap={owner_pattern + '.' + inner!r}" if inner else "activations=False")
    return f"layout=qkwatch.Layout({', '.join(parts)})"


def rotary_module(model: nn.Module) -> str | None:
    """The path of a rotary position embedding in ``model`` (a module named or typed ``rotary``/``rope``,
    or holding RoPE's ``inv_freq``/``freqs_cis`` buffer), or None."""
    for name, module in model.named_modules():
        buffers = {b for b, _ in module.named_buffers(recurse=False)}
        named = bool(name) and (ROTARY.search(type(module).__name__) or ROTARY.search(name.rsplit(".", 1)[-1]))
        if named or buffers & ROPE_BUFFERS:
            return f"{name or 'the model'} ({type(module).__name__})"
    return None


ROPE_BUFFERS = {"inv_freq", "freqs_cis", "cos_cached", "sin_cached", "rope_cache"}


def skipped(model: nn.Module, sites: Sequence[Site]) -> list[str]:
    """Attention-looking modules (``*Attention*``/``*Attn*``, ``nn.MultiheadAttention``) that are not
    a found layer, nor inside one or holding one: ``path (Type)`` each."""
    found = [s.name for s in sites]
    out = []
    for name, module in model.named_modules():
        if not name or not (ATTENTION.search(type(module).__name__) or isinstance(module, nn.MultiheadAttention)):
            continue
        related = any(name == f or name.startswith(f + ".") or f.startswith(name + ".") for f in found)
        if not related:
            cross = ", cross-attention" if CROSS.search(name.rsplit(".", 1)[-1]) else ""
            out.append(f"{name} ({type(module).__name__}{cross})")
    return out


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _sibling(path: str, leaf: str) -> str:
    return f"{path.rsplit('.', 1)[0]}.{leaf}" if "." in path else leaf


def _pattern(paths: Sequence[str]) -> str | None:
    """The paths as one pattern with ``{i}`` where the layer index goes: ``blocks.{i}.attn.qkv``;
    None unless they differ in exactly one number, which counts 0, 1, 2, ..."""
    if len(paths) < 1:
        return None
    split = [re.split(r"(?<![^.])(\d+)(?=\.)", p) for p in paths]  # a number between dots (or first)
    if len({len(s) for s in split}) != 1:
        return None
    varying = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
    numbers = [i for i in range(1, len(split[0]), 2)]
    if len(paths) == 1:
        varying = numbers[-1:] if numbers else []
    if len(varying) != 1 or varying[0] not in numbers:
        return None
    at = varying[0]
    if sorted(int(s[at]) for s in split) != list(range(len(split))):
        return None
    parts = list(split[0])
    parts[at] = "{i}"
    return "".join(parts)


def head_count(model: nn.Module) -> int | None:
    """The query head count a config the model carries holds, or None."""
    return _count(model, model, HEAD_COUNTS)


def _count(model: nn.Module, owner: nn.Module, names: tuple[str, ...]) -> int | None:
    """A head count from the attention module, else from a config the model carries (``config``,
    ``args``, ``model_args``, ``cfg``; a dataclass or a transformers config)."""
    holders: list[object] = [owner]
    for module in model.modules():
        holders += [getattr(module, a) for a in ("config", "args", "model_args", "cfg") if hasattr(module, a)]
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
