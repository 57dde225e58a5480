"""The tap of a HuggingFace ``transformers`` attention layer: its own attention function, wrapped
where the model looks it up, so that attaching changes nothing.

A transformers attention module looks its attention function up at call time:
``eager_attention_forward`` from its own module's globals, or
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. The tap wraps the function the model
will call under its own name, so the model's config, its mask building and every
``_attn_implementation == ...`` branch in its code stay exactly as they were; the wrapper hands q,
k and the mask to the probe and returns the original's result untouched. Wrappers are counted
and the originals put back when the last tap is removed.

The tap takes what the function is called with, not what a textbook attention would do: the
``scaling`` the model passes (OPT and Whisper pre-scale their queries and pass 1; Gemma 2 scales by
``query_pre_attn_scalar``; a muP model by ``1 / d_head``), its ``softcap`` (Gemma 2), the additive
mask as it is (ALiBi lives there in Falcon), T5's ``position_bias``, and a ``sliding_window`` that a
kernel applies itself (flash attention, with a padding mask only). Nothing is recomputed as
``q . k / sqrt(d)`` unless the model does that. Bloom computes its attention inline: its tap hooks
the fused projection instead (:func:`install_bloom_tap`).

(qkwatch once registered a wrapper under a new name, ``qkwatch_<impl>``: transformers then built
no mask for a name it did not know, and attached eager models stopped being causal.)
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkwatch.agent.metrics import mask_values, split_qkv_output, visible_keys
from qkwatch.agent.models.sites import AdapterError, Projections, Scoring, TapFn, wanted

logger = logging.getLogger(__name__)

EAGER = "eager_attention_forward"
"""The name a modeling module's forward calls its eager attention by (a global of that module)."""


_TAPS: dict[int, TapFn] = {}
"""id(attention module) -> tap; read by the wrappers."""


def install_attention_tap(config: Any, module: nn.Module, fn: TapFn) -> Callable[[], None]:
    """Wrap the attention functions ``module``'s forward can call (its eager one, and the one its
    config names), and route ``module``'s calls to ``fn``; returns the function that undoes it."""
    # where the forward looks its functions up (under any decorator, e.g. the ``kernels`` package's)
    namespace = inspect.unwrap(type(module).forward).__globals__
    impl = config._attn_implementation or "eager"
    patches = [_Patch.of(namespace, EAGER, "eager", namespace)]
    if impl != "eager":
        interface = namespace.get("ALL_ATTENTION_FUNCTIONS")
        if interface is None or impl not in interface:
            raise AdapterError(
                f"register {impl!r} with transformers' AttentionInterface, or load the model with "
                f"attn_implementation='sdpa': {type(module).__name__} attends through {impl!r}, which "
                f"{namespace.get('__name__', 'its module')} cannot look up"
            )
        patches.append(_Patch.of(interface, impl, impl, namespace))
    for patch in patches:
        patch.acquire()
    _TAPS[id(module)] = fn

    def remove() -> None:
        if _TAPS.get(id(module)) is fn:
            del _TAPS[id(module)]
        for patch in patches:
            patch.release()

    return remove


@dataclass
class _Patch:
    """One attention function replaced by its wrapper in one mapping (a module's globals, or an
    ``AttentionInterface``), shared by every tap that needs it and put back by the last one."""

    mapping: MutableMapping[str, Any]
    name: str
    kind: str
    users: int = 0
    original: Callable[..., Any] | None = None

    @classmethod
    def of(cls, mapping: MutableMapping[str, Any], name: str, kind: str, namespace: dict[str, Any]) -> _Patch:
        key = (id(mapping), name)
        if key not in _PATCHES:
            if name not in mapping:
                raise AdapterError(f"{namespace.get('__name__', '?')} has no {name} for qkwatch to wrap")
            _PATCHES[key] = cls(mapping, name, kind)
        return _PATCHES[key]

    def acquire(self) -> None:
        if self.users == 0:
            self.original = self.mapping[self.name]
            self.mapping[self.name] = _wrapper(self.original, self.kind)
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.original is not None:
            self.mapping[self.name] = self.original
            self.original = None
            _PATCHES.pop((id(self.mapping), self.name), None)


_PATCHES: dict[tuple[int, str], _Patch] = {}


def _wrapper(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    """``original`` (the model's attention function, called exactly as the model called it), after
    the tap of the calling module, if any, has seen q, k and the mask."""

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        tap = _TAPS.get(id(module))
        if tap is not None:
            mask = args[0] if args else kwargs.get("attention_mask")
            tap_mask, causal = _visibility(kind, module, mask, kwargs)
            t_q, seen = query.shape[-2], key
            if kind == "sdpa" and tap_mask is None and causal and 1 < t_q < key.shape[-2]:
                seen = key[..., :t_q, :]  # what sdpa_attention_forward attends (a prefill into an empty static cache)
            tap_mask, causal = _windowed(tap_mask, causal, kwargs.get("sliding_window"), t_q, seen.shape[-2])
            bias = kwargs.get("position_bias")
            if isinstance(bias, Tensor):
                tap_mask, causal = _biased(tap_mask, causal, bias, t_q, seen.shape[-2])
            tap(query, seen, tap_mask, causal, _scoring(kwargs))
        return original(module, query, key, value, *args, **kwargs)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    return attention


def _visibility(kind: str, module: nn.Module, mask: Any, kwargs: dict[str, Any]) -> tuple[Tensor | None, bool]:
    """The mask the implementation applies, and whether it adds the causal mask (see ``TapFn``).

    Eager attention adds exactly the mask it is given (none: every key). SDPA with a mask applies
    that mask alone, and without one is causal when the module (or the call's ``is_causal``) says
    so. Flash attention takes a ``(B, T_k)`` padding mask or none, causal as the module says. A
    mask that is no tensor (flex attention's ``BlockMask``) cannot be read: the module's causality
    is assumed and the padding is not seen (said once).
    """
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    if kind == "eager":
        return (mask if isinstance(mask, Tensor) else None), False
    if mask is None:
        return None, causal
    if not isinstance(mask, Tensor):
        _warn_once(kind, type(mask).__name__)
        return None, causal
    return mask, causal if mask.ndim == 2 else False


def _scoring(kwargs: dict[str, Any]) -> Scoring | None:
    """The scale and soft-cap the model called its attention with (None: the defaults)."""
    scale, softcap = kwargs.get("scaling"), kwargs.get("softcap")
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    softcap = (
        float(softcap) if isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap else None
    )
    return None if scale is None and softcap is None else Scoring(scale, softcap)


def _windowed(mask: Tensor | None, causal: bool, window: Any, t_q: int, t_k: int) -> tuple[Tensor | None, bool]:
    """A sliding window the kernel applies itself (a 4D mask already holds it): as a boolean mask,
    ``(B|1, 1, T_q, T_k)``, a query at position i seeing keys j with ``i - window < j <= i`` (causal),
    or ``|i - j| < window`` (a bidirectional encoder's local attention, ModernBERT's)."""
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or (mask is not None and mask.ndim == 4):
        return mask, causal
    device = mask.device if mask is not None else None
    rows = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    cols = torch.arange(t_k, device=device)[None, :]
    near = (cols > rows - window) & ((cols <= rows) if causal else (cols < rows + window))  # (Tq, Tk)
    seen = visible_keys(mask, False, t_q, t_k)
    return (near[None, None] if seen is None else seen & near), False


def _biased(mask: Tensor | None, causal: bool, bias: Tensor, t_q: int, t_k: int) -> tuple[Tensor, bool]:
    """T5's ``position_bias`` folded into the mask the way the model's eager attention adds it: an
    additive ``(B|1, H, T_q, T_k)`` mask, the bias where a key is seen and -inf where it is not."""
    bias = bias[..., -t_q:, :t_k].float()
    seen = visible_keys(mask, causal, t_q, t_k) if mask is not None else None
    if seen is None and causal:
        rows = torch.arange(t_k - t_q, t_k, device=bias.device)[:, None]
        seen = torch.arange(t_k, device=bias.device)[None, :] <= rows
    if seen is None:
        return bias, False
    if mask is not None and mask.is_floating_point():
        bias = bias + mask_values(mask, t_q, t_k)
    return bias.masked_fill(~seen, -math.inf), False


def install_bloom_tap(module: nn.Module, projections: Projections, n_heads: int, fn: TapFn) -> Callable[[], None]:
    """Bloom computes its attention inline (no attention function to wrap): the queries and keys come off
    its fused projection, per head (no rotary embedding), and the ALiBi bias and additive causal mask
    it adds are read from its call (``alibi (B H, 1, T_k)``, ``attention_mask (B, 1, T_q, T_k)``). A
    call with a key cache (generation) is not measured: the new keys alone are not what it attends."""
    fused = projections.qkv
    assert fused is not None, "Bloom's projections are fused"
    held: dict[str, Any] = {}
    asked = wanted(fn)

    def before(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        held.clear()
        past = kwargs.get("layer_past")
        if asked() and (past is None or not _cached_len(past, getattr(mod, "layer_idx", None))):
            held["alibi"], held["mask"] = kwargs.get("alibi"), kwargs.get("attention_mask")
            held["on"] = True

    def on_qkv(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        if not held.pop("on", False):
            return
        q, k = split_qkv_output(out, n_heads, n_heads, split="per_head")
        b, _, t, _ = q.shape
        alibi, mask = held.get("alibi"), held.get("mask")
        bias = None
        if isinstance(alibi, Tensor):
            bias = alibi.float().view(b, n_heads, 1, -1)[..., :t]
        if isinstance(mask, Tensor):
            mask = (
                mask.float()
                if mask.is_floating_point()
                else torch.zeros_like(mask, dtype=torch.float).masked_fill(~mask, -math.inf)
            )
            bias = mask if bias is None else mask + bias
        fn(q, k, bias, bias is None, None)

    handles = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        fused.register_forward_hook(on_qkv),
    ]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def _cached_len(past: Any, layer: Any) -> int:
    get = getattr(past, "get_seq_length", None)
    try:
        return int(get(layer if isinstance(layer, int) else 0)) if callable(get) else 0
    except Exception:
        return 1  # unknown: treat as cached, measure nothing rather than the wrong thing


_WARNED: set[str] = set()


def _warn_once(kind: str, mask_type: str) -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        logger.warning(
            "qkwatch cannot read %s's %s: attention statistics assume the module's causal mask and include padded keys",
            kind,
            mask_type,
        )
