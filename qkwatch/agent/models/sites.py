"""What the agent knows of one attention layer (a :class:`Site`), and the taps that read its q and k.

A site is found by an adapter (``agent.models.adapters``, ``agent.models.hf_models``) and used by the probe:
its weights are read in the attention module's forward (under FSDP2 its parameters are unsharded
there) and its tap hands the probe the queries and keys the model attends with, together with the
mask the model attends under. Nothing here changes what the model computes: hooks only read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from qkwatch.agent.metrics import split_heads, split_qkv, split_qkv_output


@dataclass(frozen=True)
class Scoring:
    """How a model turns ``q . k`` into the logits it softmaxes, besides the mask (``agent.metrics.scored_logits``)."""

    scale: float | None = None
    """The factor on ``q . k``; None: ``1 / sqrt(d_head)``."""
    softcap: float | None = None
    """Logits soft-capped as ``softcap * tanh(x / softcap)`` (Gemma 2); None: not capped."""


class TapFn(Protocol):
    """Receives what one attention layer attends with.

    ``q (B, n_heads, T_q, d_head)`` and ``k (B, n_kv_heads, T_k, d_head)``; ``mask`` the mask the
    model's attention was given (None, a boolean or additive ``(B|1, 1|H, T_q, T_k)`` tensor, or a
    ``(B, T_k)`` key-padding mask), and ``causal`` whether the attention applies the causal mask on
    top of it (``agent.metrics.visible_keys`` turns the two into the keys each row sees). The finite
    values of an additive mask are a bias the model adds to its logits (ALiBi, T5's position bias);
    ``scoring`` the model's own scale and soft-cap (None: ``1 / sqrt(d_head)``, no cap).

    A tap function may carry ``wanted``, a callable that says whether it would use the tensors now
    (the probe's: a report is armed and the layer not measured yet): a tap that must first cut q and
    k out of a fused output skips that work when it says no (:func:`wanted`).
    """

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        mask: Tensor | None = None,
        causal: bool | None = None,
        scoring: Scoring | None = None,
    ) -> None: ...


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
    """Each query sees the keys up to its own position when the tap passes no mask."""
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
    """Rows ``[q; k; v]`` (an ``nn.Linear``), or columns (``conv1d``: GPT-2's ``Conv1D``), in the
    order ``split`` names (``agent.metrics.SPLITS``)."""
    conv1d: bool = False
    split: str = "qkv"

    def weights(self, h: int, g: int) -> Callable[[], tuple[Tensor, Tensor, None]]:
        """Per-head ``wq (H, D, hs)`` and ``wk (G, D, hs)``, read when called."""
        qkv, q, k = self.qkv, self.q, self.k
        if qkv is not None:
            return lambda: _fused(weight_of(qkv), h, g, conv1d=self.conv1d, split=self.split)
        if q is None or k is None:
            raise AdapterError("projections need either qkv, or both q and k")
        return lambda: (split_heads(weight_of(q), h), split_heads(weight_of(k), g), None)

    def tap(self, h: int, g: int) -> Callable[[TapFn], Callable[[], None]]:
        """Installs a tap on the projections' outputs (q and k before any rotary embedding)."""
        qkv, q, k = self.qkv, self.q, self.k
        if qkv is not None:
            return lambda fn: forward_hook_tap(qkv, _split_output(fn, h, g, self.split), output=True)
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


def wanted(fn: TapFn) -> Callable[[], bool]:
    """``fn.wanted`` when it has one, else always yes. Never asked while ``torch.compile`` traces:
    the compiled graph keeps the tap whole, and the probe decides at run time (see ``agent.probe``)."""
    asked: Callable[[], bool] | None = getattr(fn, "wanted", None)
    if asked is None:
        return lambda: True
    return lambda: torch.compiler.is_compiling() or asked()


def forward_hook_tap(module: nn.Module, fn: Callable[[Any], None], *, output: bool = False) -> Callable[[], None]:
    """A forward hook that hands ``fn`` the module's output (or its positional arguments); only reads."""
    if output:
        handle = module.register_forward_hook(lambda mod, args, out: fn(out))
    else:
        handle = module.register_forward_hook(lambda mod, args, out: fn(args))
    return handle.remove


def module_tap(module: nn.Module, causal: bool | None = None) -> Callable[[TapFn], Callable[[], None]]:
    """Installs a tap on a module called as ``module(q, k, ...)`` with the tensors the model attends
    with. A mask it is called with (SDPA's order, ``(q, k, v, mask)``, or ``attn_mask=``,
    ``attention_mask=``, ``mask=``) and its ``is_causal=`` are handed on; else ``causal`` (None: the site's)."""

    def install(fn: TapFn) -> Callable[[], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if len(args) < 2:
                return
            mask = args[3] if len(args) > 3 and isinstance(args[3], Tensor) else None  # (q, k, v, mask)
            for name in ("attn_mask", "attention_mask", "mask"):
                if mask is None and isinstance(kwargs.get(name), Tensor):
                    mask = kwargs[name]
            told = kwargs.get("is_causal")
            seen_causal = told if isinstance(told, bool) else causal
            if mask is not None and not isinstance(told, bool):
                seen_causal = False  # a mask given alone is the whole mask (SDPA's convention)
            fn(args[0], args[1], mask, seen_causal)

        return module.register_forward_pre_hook(hook, with_kwargs=True).remove

    return install


def _split_output(fn: TapFn, h: int, g: int, split: str) -> Callable[[Tensor], None]:
    asked = wanted(fn)

    def tap(out: Tensor) -> None:
        if not asked():
            return  # no report armed: no split, views or transposes on this forward
        fn(*split_qkv_output(out, h, g, split=split))  # out: (B, T, (H + 2G) hs)

    return tap


def _pair_tap(q_mod: nn.Module, k_mod: nn.Module, fn: TapFn, h: int, g: int) -> Callable[[], None]:
    held: dict[str, Tensor] = {}
    asked = wanted(fn)

    def on_q(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        if asked():
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


def _fused(weight: Tensor, h: int, g: int, *, conv1d: bool = False, split: str = "qkv") -> tuple[Tensor, Tensor, None]:
    wq, wk, _ = split_qkv(weight, h, g, conv1d=conv1d, split=split)
    return wq, wk, None


def weight_of(module: nn.Module) -> Tensor:
    """A projection's ``weight`` (an ``nn.Linear``'s, GPT-2's ``Conv1D``'s, a layout's module's).

    A PEFT LoRA layer wraps its ``base_layer``: its weight is the one the model computes with, the
    base weight plus each active, unmerged adapter's ``scaling x B A`` (``get_delta_weight``).
    """
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and hasattr(module, "get_delta_weight"):
        return _lora_weight(module, base)
    weight = module.weight
    if not isinstance(weight, Tensor):
        raise AdapterError(f"{type(module).__name__}.weight is a {type(weight).__name__}, not a tensor")
    return weight


def is_projection(module: object) -> bool:
    """An ``nn.Linear``, or a PEFT LoRA layer around one."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)


def _lora_weight(module: nn.Module, base: nn.Module) -> Tensor:
    weight = weight_of(base)
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return weight  # merged: already in the base weight; disabled: the base alone computes
    get_delta: Callable[[str], Tensor] = module.get_delta_weight  # type: ignore[assignment]
    active = getattr(module, "active_adapters", None) or []
    deltas = [get_delta(name) for name in active if name in getattr(module, "lora_A", {})]
    return weight + sum(d.to(weight.dtype) for d in deltas) if deltas else weight


def numbered(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Named modules in natural order of their layer numbers (``layers.10`` after ``layers.9``)."""
    named = list(model.named_modules())
    return sorted(named, key=lambda item: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", item[0])])
