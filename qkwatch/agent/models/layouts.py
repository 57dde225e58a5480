"""One map of model internals: where a model keeps each layer's query and key projections.

A :class:`Layout` names the modules by path pattern (``{i}`` = layer index). A checkpoint's
tensor is the module path plus ``.weight``, so the same layout serves offline analysis of a state
dict on disk (``qkwatch analyze``) and the live agent on a module tree (``qkwatch.attach(model,
layout=...)`` for a model no adapter knows). Checkpoints may carry a prefix (``bert.``,
``model.``, ``transformer.``, ``module.``): detection finds it.

Pure: strings in, strings out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any


class LayoutError(Exception):
    """No known layout fits; the message lists what was looked for and how to map it by hand."""


@dataclass(frozen=True)
class Layout:
    """Where each layer's query and key projections are, and how many heads attend through them."""

    name: str = "custom"
    """Architecture family, e.g. ``"gpt2"``."""
    q: str | None = None
    """Query projection module path (an ``nn.Linear``), e.g. ``"encoder.layer.{i}.attention.self.query"``."""
    k: str | None = None
    """Key projection module path."""
    qkv: str | None = None
    """Fused QKV projection module path (nanoGPT's ``c_attn``, GPT-2's Conv1D); ``split`` says how its
    rows are ordered."""
    split: str | None = None
    """A fused projection's row order, which its shape cannot tell: ``"qkv"`` (``[q; k; v]``: nanoGPT,
    GPT-2), ``"per_head"`` (``[q_0; k_0; v_0; q_1; ...]``: GPT-NeoX) or ``"per_kv_head"`` (each key/value
    head's group of queries, then its key and value: Megatron-core, torchtitan); see
    ``qkwatch.agent.metrics.SPLITS``. Required with ``qkv``."""
    conv1d: bool = False
    """The fused weight is stored transposed, ``(d_model, 3 d_model)`` (GPT-2 ``Conv1D``)."""
    rotation: str | None = None
    """Householder key-rotation vectors ``(n_kv_heads, p, d_head)`` (qkwatch's GPT with RAA; offline)."""
    tap: str | None = None
    """Live models: a module called as ``tap(q, k)`` with the tensors the model attends with (after
    RoPE); without it q and k are the projections' outputs (right for models without rotary embeddings)."""
    causal: bool = True
    """Live models: each query attends to the keys up to its own position (False for an encoder)."""
    activations: bool = True
    """Live models: measure the activation metrics too. A model with rotary embeddings needs ``tap``
    for them (its projections' outputs are not what it attends); ``False`` measures its weights alone."""
    n_heads: int | None = None
    """Query heads; None: from the checkpoint's config (offline). A live model needs it."""
    n_kv_heads: int | None = None
    """Key/value heads (GQA); None: from the config, else ``n_heads``."""
    layers: tuple[str, ...] = ("num_hidden_layers", "n_layer", "n_layers")
    """Config keys that may hold the layer count (and below: the head counts, width and head size)."""
    heads: tuple[str, ...] = ("num_attention_heads", "n_head", "n_heads")
    kv_heads: tuple[str, ...] = ("num_key_value_heads", "n_kv_heads", "n_kv_head")
    width: tuple[str, ...] = ("hidden_size", "n_embd", "d_model")
    head_dim: tuple[str, ...] = ("head_dim", "d_head")
    prefix: str = ""
    """Prefix found in the checkpoint's keys (set by :func:`detect`)."""

    @property
    def names_projections(self) -> bool:
        """Whether it says where the projections are (else it carries head counts only)."""
        return bool(self.qkv or self.q or self.k)

    def module_paths(self, layer: int) -> list[str]:
        """The projection modules of ``layer``: ``[qkv]``, or ``[q, k]``."""
        paths = [self.qkv] if self.qkv else [self.q, self.k]
        return [f"{self.prefix}{p.format(i=layer)}" for p in paths if p]

    def weight_keys(self, layer: int) -> list[str]:
        return [f"{path}.weight" for path in self.module_paths(layer)]

    def rotation_key(self, layer: int) -> str | None:
        return f"{self.prefix}{self.rotation.format(i=layer)}" if self.rotation else None

    def tap_path(self, layer: int) -> str | None:
        return f"{self.prefix}{self.tap.format(i=layer)}" if self.tap else None


LAYOUTS = (
    Layout(
        "qkwatch-gpt",
        q="blocks.{i}.attn.q_proj",
        k="blocks.{i}.attn.k_proj",
        rotation="blocks.{i}.attn.key_rotation.vectors",
    ),
    Layout("bert", q="encoder.layer.{i}.attention.self.query", k="encoder.layer.{i}.attention.self.key"),
    Layout("gpt2", qkv="h.{i}.attn.c_attn", split="qkv", conv1d=True),
    Layout("nanogpt", qkv="transformer.h.{i}.attn.c_attn", split="qkv"),
    Layout("gpt_neox", qkv="layers.{i}.attention.query_key_value", split="per_head"),
    Layout("llama", q="layers.{i}.self_attn.q_proj", k="layers.{i}.self_attn.k_proj"),
)
"""Known layouts; ``llama`` covers Llama, Mistral, Qwen2/3 and their GQA (``num_key_value_heads``)."""

_PREFIXES = ("", "model.", "bert.", "transformer.", "module.", "model.model.", "gpt_neox.")


def detect(keys: Iterable[str], config: Mapping[str, Any]) -> Layout:
    """The layout whose layer-0 weights the checkpoint holds (the model type breaks ties)."""
    keys = set(keys)
    hint = str(config.get("model_type", "")).lower()
    found = [
        replace(layout, prefix=prefix)
        for layout in LAYOUTS
        for prefix in _PREFIXES
        if all(key in keys for key in replace(layout, prefix=prefix).weight_keys(0))
    ]
    if not found:
        raise LayoutError(_not_found_message(keys))
    # GPT-2 (Conv1D) and nanoGPT (Linear) share key names; the stored shape decides (see resolve).
    found.sort(key=lambda layout: (layout.name != hint and not hint.startswith(layout.name), len(layout.prefix)))
    return found[0]


def custom(
    q: str | None,
    k: str | None,
    qkv: str | None,
    conv1d: bool = False,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    split: str | None = None,
) -> Layout:
    """A layout from user-supplied weight key patterns (``--q-key``/``--k-key`` or ``--qkv-key``).

    Without any pattern it carries only the head counts (the layout itself is then detected).
    """
    if not (q or k or qkv):
        return Layout(n_heads=n_heads, n_kv_heads=n_kv_heads)
    if qkv and (q or k):
        raise LayoutError("give either --qkv-key or both --q-key and --k-key, not both")
    if not qkv and not (q and k):
        raise LayoutError("give both --q-key and --k-key (or --qkv-key for a fused projection)")
    if qkv and split is None:
        raise LayoutError(
            "add --split qkv|per_head|per_kv_head to --qkv-key: the order of its rows ([q; k; v], per head, "
            "or per key/value head) cannot be told from its shape"
        )
    for pattern in (q, k, qkv):
        if pattern and "{i}" not in pattern:
            raise LayoutError(f"key pattern {pattern!r} must contain {{i}} where the layer index goes")
    return Layout(
        "custom",
        q=_module_path(q),
        k=_module_path(k),
        qkv=_module_path(qkv),
        split=split,
        conv1d=conv1d,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
    )


def _module_path(pattern: str | None) -> str | None:
    return pattern.removesuffix(".weight") if pattern else None


def count_layers(layout: Layout, keys: Iterable[str]) -> int:
    """Number of consecutive layers from 0 whose weights are present."""
    keys = set(keys)
    n = 0
    while all(key in keys for key in layout.weight_keys(n)):
        n += 1
    return n


def first(config: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    return next((config[n] for n in names if config.get(n) is not None), None)


def _not_found_message(keys: set[str]) -> str:
    looked = "; ".join(f"{layout.name}: {', '.join(layout.weight_keys(0))}" for layout in LAYOUTS)
    sample = sorted(keys, key=_natural)[:12]
    return (
        "no known attention layout in this checkpoint. Looked for (with optional prefixes "
        f"{', '.join(repr(p) for p in _PREFIXES if p)}): {looked}. Its keys include: {', '.join(sample)}. "
        "Map it explicitly with --q-key/--k-key (or --qkv-key [--conv1d]) using {i} for the layer "
        "index, e.g. --q-key 'blocks.{i}.attn.wq' --k-key 'blocks.{i}.attn.wk', and --n-heads."
    )


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]
