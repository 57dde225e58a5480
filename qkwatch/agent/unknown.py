"""When the adapters do not know a model: what it holds, and the one line that names its layout.

:func:`suggest_layout` looks for the projections an attention layer is made of, under the names
people give them (``q``/``k``, ``q_proj``, ``query``, ``to_q``, ``wq``; fused ``qkv``, ``Wqkv``,
``query_key_value``, ``in_proj``), finds the part of their path that counts the layers, and writes
the ``layout=qkwatch.Layout(...)`` that :func:`qkwatch.agent.adapters.find_sites` then follows.
:func:`skipped` names the attention-looking modules a finder did not turn into a layer, so that
attaching never monitors some layers and silently not the others.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from qkwatch.agent.sites import Site

QUERY = ("q_proj", "query", "to_q", "wq", "q_lin", "query_proj", "q")
KEY = ("k_proj", "key", "to_k", "wk", "k_lin", "key_proj", "k")
FUSED = ("qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj", "to_qkv", "c_attn", "att_proj")
HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead")
ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)


def suggest_layout(model: nn.Module) -> str | None:
    """``layout=qkwatch.Layout(...)`` for the attention projections found in ``model``, or None."""
    linears = {name: m for name, m in model.named_modules() if _linear(m)}
    for fused in FUSED:
        found = [n for n in linears if n.rsplit(".", 1)[-1] == fused]
        pattern = _pattern(found)
        if pattern:
            return f"layout=qkwatch.Layout(qkv={pattern!r}, n_heads={_heads(model, found[0])})"
    for q_name, k_name in zip(QUERY, KEY, strict=True):
        qs = [n for n in linears if n.rsplit(".", 1)[-1] == q_name]
        ks = {n for n in linears if n.rsplit(".", 1)[-1] == k_name}
        pairs = [q for q in qs if _sibling(q, k_name) in ks]
        pattern = _pattern(pairs)
        if pattern:
            k_pattern = _sibling(pattern, k_name)
            return f"layout=qkwatch.Layout(q={pattern!r}, k={k_pattern!r}, n_heads={_heads(model, pairs[0])})"
    return None


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
            out.append(f"{name} ({type(module).__name__})")
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


def _heads(model: nn.Module, projection: str) -> str:
    """The head count of the module above a projection, when it says; else ``...`` for the user."""
    owner = model.get_submodule(projection.rsplit(".", 1)[0]) if "." in projection else model
    for name in HEAD_COUNTS:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return str(value)
    return "..."
