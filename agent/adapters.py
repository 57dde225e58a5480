"""The one place that knows model internals: where each layer's W_Q, W_K and live q, k are.

A :class:`Site` is one attention layer: a module whose forward the weights are read in (under
FSDP2 its parameters are unsharded there), a function returning the per-head factors in math
layout, and a way to see the queries and keys the model really attends with (after RoPE and any
key rotation) without changing how it attends.

Known models:

* qkwatch's own GPT (``trainer.model``): ``Attention.qk_weights()`` and the identity ``qk_tap``;
  ``Attention.remove_outlier`` (the ``outlier_removed`` variant) is carried on the site.
* HuggingFace ``transformers`` models whose attention goes through ``AttentionInterface``
  (Llama, Mistral, Qwen2/3 with GQA and RoPE; BERT; GPT-2 with its fused Conv1D): a wrapper
  registered as ``qkwatch_<impl>`` sees (module, q, k) and calls the model's own implementation
  (``sdpa``, flash, eager: unchanged); the model's config is pointed at it and restored on close.
* nanoGPT's ``CausalSelfAttention`` (fused ``c_attn``, no rotary embedding): q and k are read
  off ``c_attn``'s output.
* anything else through an explicit :class:`qkwatch.agent.layouts.Layout` (module paths of the projections,
  head counts, and the module to tap after RoPE).

Every site read off its projections (the last three kinds) is built by one function,
:func:`projection_site`; qkwatch's GPT hands over its own weights and tap.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from qkwatch.agent.layouts import Layout
from qkwatch.agent.metrics import split_heads, split_qkv

if TYPE_CHECKING:
    from typing_extensions import TypeIs

TapFn = Callable[[Tensor, Tensor], None]
"""Receives ``q (B, n_heads, T, d_head)`` and ``k (B, n_kv_heads, T, d_head)``.

A tap function may carry ``wanted``, a callable that says whether it would use the tensors now
(the probe's: a report is armed and the layer not measured yet): a tap that must first cut q and
k out of a fused output skips that work when it says no (:func:`_wanted`)."""


def _wanted(fn: TapFn) -> Callable[[], bool]:
    """``fn.wanted`` when it has one, else always yes. Never asked while ``torch.compile`` traces:
    the compiled graph keeps the tap whole, and the probe decides at run time (see ``agent.probe``)."""
    wanted: Callable[[], bool] | None = getattr(fn, "wanted", None)
    if wanted is None:
        return lambda: True
    return lambda: torch.compiler.is_compiling() or wanted()


class AdapterError(Exception):
    """No attention found (or a layout that does not fit); the message lists what was seen."""


@dataclass
class Site:
    layer: int
    name: str
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    d_head: int
    causal: bool
    weights: Callable[[], tuple[Tensor, Tensor, Tensor | None]]
    """Per-head ``wq (H, D, hs)``, ``wk (G, D, hs)`` and the key rotation ``(G, hs, hs)`` or None."""
    install_tap: Callable[[TapFn], Callable[[], None]]
    """Installs a tap; returns the function that removes it."""
    remove_outlier: bool = False
    """The model attends with ``A - U`` (seed 003's ``A - 1 1^T / T``, ``U`` the uniform row over the
    visible keys) instead of ``A``: the spectrum is then measured on ``A - U``."""


@dataclass(frozen=True)
class Projections:
    """One layer's query and key projections: separate ``q`` and ``k``, or one fused ``qkv``."""

    q: nn.Module | None = None
    k: nn.Module | None = None
    qkv: nn.Module | None = None
    """Rows ``[q; k; v]`` (an ``nn.Linear``), or columns (``conv1d``: GPT-2's ``Conv1D``)."""
    conv1d: bool = False

    def weights(self, h: int, g: int) -> Callable[[], tuple[Tensor, Tensor, None]]:
        """Per-head ``wq (H, D, hs)`` and ``wk (G, D, hs)``, read when called."""
        qkv, q, k = self.qkv, self.q, self.k
        if qkv is not None:
            return lambda: _fused(_weight(qkv), h, g, conv1d=self.conv1d)
        if q is None or k is None:
            raise AdapterError("projections need either qkv, or both q and k")
        return lambda: (split_heads(_weight(q), h), split_heads(_weight(k), g), None)

    def tap(self, h: int, g: int) -> Callable[[TapFn], Callable[[], None]]:
        """Installs a tap on the projections' outputs (q and k before any rotary embedding)."""
        qkv, q, k = self.qkv, self.q, self.k
        if qkv is not None:
            return lambda fn: _forward_hook_tap(qkv, _split_output(fn, h, g), output=True)
        if q is None or k is None:
            raise AdapterError("projections need either qkv, or both q and k")
        return lambda fn: _pair_tap(q, k, fn, h, g)


def projection_site(
    layer: int,
    name: str,
    module: nn.Module,
    projections: Projections,
    n_heads: int,
    n_kv_heads: int,
    *,
    d_head: int | None = None,
    causal: bool = True,
    install_tap: Callable[[TapFn], Callable[[], None]] | None = None,
) -> Site:
    """A site whose weights are its projections'; q and k from their outputs unless ``install_tap``
    reads them where the model attends (after RoPE). ``d_head`` defaults to the weights' head size."""
    weights = projections.weights(n_heads, n_kv_heads)
    return Site(
        layer=layer,
        name=name,
        module=module,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=d_head or weights()[0].shape[-1],
        causal=causal,
        weights=weights,
        install_tap=install_tap or projections.tap(n_heads, n_kv_heads),
    )


def find_sites(model: nn.Module, layout: Layout | None = None) -> list[Site]:
    """Every attention layer of ``model``, in layer order; where ``layout`` says, if given.

    Raises:
        AdapterError: nothing found (the message lists the module types seen), or a layout that
            does not fit the model.
    """
    if layout is not None:
        return _laid_out(model, layout)
    for finder in (_qkwatch_gpt, _huggingface, _nanogpt):
        sites = finder(model)
        if sites:
            return sites
    kinds = sorted({type(m).__name__ for m in model.modules()})
    raise AdapterError(
        "found no attention layers the agent knows (qkwatch GPT, HuggingFace Llama/Mistral/Qwen/BERT/GPT-2, "
        f"nanoGPT). Module types in this model: {', '.join(kinds[:40])}"
        f"{' ...' if len(kinds) > 40 else ''}. Pass layout=qkwatch.Layout(q='layers.{{i}}.wq', "
        "k='layers.{i}.wk', n_heads=..., tap=...) to name them."
    )


# --- qkwatch's GPT ----------------------------------------------------------------------------


class _GPTAttention(Protocol):
    """What the agent uses of qkwatch's GPT attention (``trainer.model.Attention``)."""

    n_heads: int
    n_kv_heads: int
    d_head: int
    qk_tap: nn.Module
    """An identity module called as ``qk_tap(q, k)`` with the tensors the model attends with."""

    def qk_weights(self) -> tuple[Tensor, Tensor, Tensor | None]: ...


def _is_gpt_attention(module: object) -> TypeIs[_GPTAttention]:
    """Known by what it has: the agent never imports the trainer."""
    return hasattr(module, "qk_tap") and hasattr(module, "qk_weights")


def _qkwatch_gpt(model: nn.Module) -> list[Site]:
    sites: list[Site] = []
    for name, module in _numbered(model):
        if not _is_gpt_attention(module):
            continue
        sites.append(
            Site(
                layer=len(sites),
                name=name,
                module=module,
                n_heads=module.n_heads,
                n_kv_heads=module.n_kv_heads,
                d_head=module.d_head,
                causal=True,
                weights=_gpt_weights(module),
                install_tap=_module_tap(module.qk_tap),
                remove_outlier=bool(getattr(module, "remove_outlier", False)),
            )
        )
    return sites


def _gpt_weights(module: _GPTAttention) -> Callable[[], tuple[Tensor, Tensor, Tensor | None]]:
    def weights() -> tuple[Tensor, Tensor, Tensor | None]:
        wq, wk, rotation = module.qk_weights()
        return split_heads(wq, module.n_heads), split_heads(wk, module.n_kv_heads), rotation

    return weights


# --- HuggingFace transformers -----------------------------------------------------------------

_HF_TAPS: dict[int, TapFn] = {}
"""id(attention module) -> tap; read by the registered attention wrappers."""


def _huggingface(model: nn.Module) -> list[Site]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return []
    n_heads = _cfg(config, "num_attention_heads", "n_head")
    if not n_heads:
        return []
    n_kv = _cfg(config, "num_key_value_heads") or n_heads
    width = _cfg(config, "hidden_size", "n_embd")
    d_head = _cfg(config, "head_dim") or (width // n_heads if width else None)  # None: the weights' head size
    sites: list[Site] = []
    for name, module in _numbered(model):
        projections = _hf_projections(module)
        if projections is None:
            continue
        site = projection_site(
            len(sites),
            name,
            module,
            projections,
            n_heads,
            n_kv,
            d_head=d_head,
            causal=bool(getattr(module, "is_causal", True)),
            install_tap=partial(_hf_tap, model, config, module),
        )
        sites.append(site)
    return sites


def _hf_projections(module: nn.Module) -> Projections | None:
    for q, k in (("q_proj", "k_proj"), ("query", "key")):
        q_mod, k_mod = getattr(module, q, None), getattr(module, k, None)
        if isinstance(q_mod, nn.Linear) and isinstance(k_mod, nn.Linear):
            return Projections(q=q_mod, k=k_mod)
    c_attn = getattr(module, "c_attn", None)
    if c_attn is not None and type(c_attn).__name__ == "Conv1D" and not getattr(module, "is_cross_attention", False):
        return Projections(qkv=c_attn, conv1d=True)
    return None


def _hf_tap(model: nn.Module, config: Any, module: nn.Module, fn: TapFn) -> Callable[[], None]:
    """Point ``config`` (``model.config``, a transformers ``PretrainedConfig``) at the wrapper that taps ``module``."""
    original = config._attn_implementation or "eager"
    if not original.startswith("qkwatch_"):
        name = f"qkwatch_{original}"
        _register_hf_wrapper(name, original, type(module).__module__)
        config._attn_implementation = name
    _HF_TAPS[id(module)] = fn

    def remove() -> None:
        _HF_TAPS.pop(id(module), None)
        current = config._attn_implementation or ""
        if current.startswith("qkwatch_") and not any(_HF_TAPS.get(id(m)) for m in model.modules()):
            config._attn_implementation = current.removeprefix("qkwatch_")

    return remove


def _register_hf_wrapper(name: str, original: str, modeling_module: str) -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(modeling_module), "eager_attention_forward", None) or _no_eager(modeling_module)

    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> Any:
        """The model's own implementation (its result unchanged), after the tap has seen q and k."""
        tap = _HF_TAPS.get(id(module))
        if tap is not None:
            tap(query, key)
        impl = eager if original == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(original, eager)
        return impl(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)


def _no_eager(modeling_module: str) -> Callable[..., Any]:
    """Stands in for a modeling module's missing ``eager_attention_forward``: says so when called."""

    def attention(*args: Any, **kwargs: Any) -> Any:
        raise AdapterError(f"{modeling_module} has no eager_attention_forward for qkwatch to call")

    return attention


def _cfg(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# --- nanoGPT ----------------------------------------------------------------------------------


def _nanogpt(model: nn.Module) -> list[Site]:
    sites: list[Site] = []
    for name, module in _numbered(model):
        c_attn = getattr(module, "c_attn", None)
        n_head = getattr(module, "n_head", None)
        if not isinstance(c_attn, nn.Linear) or not isinstance(n_head, int):
            continue
        d_head = c_attn.in_features // n_head
        sites.append(projection_site(len(sites), name, module, Projections(qkv=c_attn), n_head, n_head, d_head=d_head))
    return sites


# --- an explicit layout ------------------------------------------------------------------------


def _laid_out(model: nn.Module, layout: Layout) -> list[Site]:
    """Layers 0, 1, ... for as long as the layout's projection modules exist."""
    if not layout.n_heads:
        raise AdapterError("a layout needs n_heads")
    if bool(layout.qkv) == bool(layout.q or layout.k) or (not layout.qkv and not (layout.q and layout.k)):
        raise AdapterError("a layout needs either qkv, or both q and k")
    for pattern in (layout.q, layout.k, layout.qkv, layout.tap):
        if pattern and "{i}" not in pattern:
            raise AdapterError(f"layout path {pattern!r} must contain {{i}} where the layer index goes")
    modules = dict(model.named_modules())
    h, g = layout.n_heads, layout.n_kv_heads or layout.n_heads
    sites: list[Site] = []
    for i in itertools.count():
        paths = layout.module_paths(i)
        if not all(p in modules for p in paths):
            break
        owner = modules[paths[0].rsplit(".", 1)[0]] if "." in paths[0] else model
        found = [modules[p] for p in paths]
        projections = Projections(qkv=found[0], conv1d=layout.conv1d) if layout.qkv else Projections(*found)
        tap_path = layout.tap_path(i)
        if tap_path is not None and tap_path not in modules:
            raise AdapterError(f"layout.tap: no module named {tap_path!r}")
        install = _module_tap(modules[tap_path]) if tap_path else None
        sites.append(projection_site(i, paths[0], owner, projections, h, g, causal=layout.causal, install_tap=install))
    if not sites:
        raise AdapterError(f"layout matched no module for layer 0 ({layout.q or layout.qkv!r})")
    return sites


def _fused(weight: Tensor, h: int, g: int, *, conv1d: bool = False) -> tuple[Tensor, Tensor, None]:
    wq, wk, _ = split_qkv(weight, h, g, conv1d=conv1d)
    return wq, wk, None


# --- taps -------------------------------------------------------------------------------------


def _forward_hook_tap(module: nn.Module, fn: Callable[[Any], None], *, output: bool = False) -> Callable[[], None]:
    if output:
        handle = module.register_forward_hook(lambda mod, args, out: fn(out))
    else:
        handle = module.register_forward_hook(lambda mod, args, out: fn(args))
    return handle.remove


def _module_tap(module: nn.Module) -> Callable[[TapFn], Callable[[], None]]:
    """Installs a tap on a module called as ``module(q, k)`` with the tensors the model attends with."""
    return lambda fn: _forward_hook_tap(module, lambda args: fn(args[0], args[1]))


def _split_output(fn: TapFn, h: int, g: int) -> Callable[[Tensor], None]:
    wanted = _wanted(fn)

    def tap(out: Tensor) -> None:
        if not wanted():
            return  # no report armed: no split, views or transposes on this forward
        b, t, width = out.shape  # (B, T, (H + 2G) hs)
        hs = width // (h + 2 * g)
        q, k, _ = torch.split(out, [h * hs, g * hs, g * hs], dim=-1)
        fn(q.view(b, t, h, hs).transpose(1, 2), k.view(b, t, g, hs).transpose(1, 2))

    return tap


def _pair_tap(q_mod: nn.Module, k_mod: nn.Module, fn: TapFn, h: int, g: int) -> Callable[[], None]:
    held: dict[str, Tensor] = {}
    wanted = _wanted(fn)

    def on_q(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        if wanted():
            held["q"] = out

    def on_k(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        q = held.pop("q", None)
        if q is not None:
            b, t, _ = out.shape
            fn(q.view(b, t, h, -1).transpose(1, 2), out.view(b, t, g, -1).transpose(1, 2))

    handles = [q_mod.register_forward_hook(on_q), k_mod.register_forward_hook(on_k)]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def _weight(module: nn.Module) -> Tensor:
    """A projection's ``weight`` (an ``nn.Linear``'s, GPT-2's ``Conv1D``'s, a layout's module's)."""
    weight = module.weight
    if not isinstance(weight, Tensor):
        raise AdapterError(f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor")
    return weight


def _numbered(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Named modules in natural order of their layer numbers (``layers.10`` after ``layers.9``)."""
    named = list(model.named_modules())
    return sorted(named, key=lambda item: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", item[0])])
