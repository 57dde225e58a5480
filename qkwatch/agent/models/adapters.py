"""Where each model keeps its attention: the adapters, tried in order by :func:`find_sites`.

Known models:

* qkwatch's own GPT (``trainer.model``): ``Attention.qk_weights()`` and the identity ``qk_tap``;
  ``Attention.remove_outlier`` (the ``outlier_removed`` variant) is carried on the site.
* HuggingFace ``transformers`` models whose attention goes through ``AttentionInterface``
  (Llama, Mistral, Qwen2/3 with GQA and RoPE; BERT; GPT-2 with its fused Conv1D):
  ``agent.models.hf_models``, whose tap (``agent.models.hf_taps``) wraps the model's own attention
  function without renaming it.
* nanoGPT's ``CausalSelfAttention`` (fused ``c_attn``, no rotary embedding): q and k are read
  off ``c_attn``'s output.
* anything else through an explicit :class:`qkwatch.agent.models.layouts.Layout` (module paths of the
  projections, head counts, and the module to tap after RoPE).

Every adapter only reads: attaching leaves the model's outputs and gradients bit for bit as they
were (``tests/agent/test_invisible.py`` runs every adapter in :data:`FINDERS`, and a layout).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor, nn

import qkwatch.agent.models.frameworks as frameworks
from qkwatch.agent.metrics import SPLITS, split_heads
from qkwatch.agent.models.hf_models import find as _huggingface
from qkwatch.agent.models.layouts import Layout
from qkwatch.agent.models.sites import (
    AdapterError,
    Projections,
    Site,
    TapFn,
    module_tap,
    numbered,
    projection_site,
    wanted,
)
from qkwatch.agent.models.unknown import head_count, rotary_module, skipped, suggest_layout

if TYPE_CHECKING:
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

__all__ = ["FINDERS", "AdapterError", "Projections", "Site", "TapFn", "find_sites", "projection_site"]


def find_sites(model: nn.Module, layout: Layout | None = None) -> list[Site]:
    """Every attention layer of ``model``, in layer order; where ``layout`` says, if given.

    Raises:
        AdapterError: nothing found, or a layout that does not fit the model: one line, the fix first
            (the ``layout=qkwatch.Layout(...)`` to pass, with the model's own paths and head counts).
    """
    if layout is not None:
        return _laid_out(model, layout)
    for finder in FINDERS:
        sites = finder(model)
        if sites:
            left_out = skipped(model, sites)
            if left_out:
                logger.warning(
                    "qkwatch monitors %d attention layers and skips %d it does not measure: %s",
                    len(sites),
                    len(left_out),
                    ", ".join(left_out[:20]) + (" ..." if len(left_out) > 20 else ""),
                )
            return sites
    attention = skipped(model, [])
    suggested = suggest_layout(model)
    seen = ", ".join(attention[:3]) + (f" and {len(attention) - 3} more" if len(attention) > 3 else "")
    if suggested:
        raise AdapterError(
            f"pass {suggested} to qkwatch.attach: no adapter knows {type(model).__name__}'s attention ({seen})"
        )
    kinds = sorted({type(m).__name__ for m in model.modules()})
    raise AdapterError(
        "pass layout=qkwatch.Layout naming its query and key projections' paths and n_heads: "
        f"qkwatch found no attention layer in {type(model).__name__} "
        f"(attention-like modules: {seen or 'none'}; module types: {', '.join(kinds[:12])}"
        f"{' ...' if len(kinds) > 12 else ''})"
    )


# --- qkwatch's GPT ----------------------------------------------------------------------------


class _GPTAttention(Protocol):
    """What the agent uses of qkwatch's GPT attention (``trainer.model.gpt.Attention``)."""

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
    for name, module in numbered(model):
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
                install_tap=module_tap(module.qk_tap),
                remove_outlier=bool(getattr(module, "remove_outlier", False)),
            )
        )
    return sites


def _gpt_weights(module: _GPTAttention) -> Callable[[], tuple[Tensor, Tensor, Tensor | None]]:
    def weights() -> tuple[Tensor, Tensor, Tensor | None]:
        wq, wk, rotation = module.qk_weights()
        return split_heads(wq, module.n_heads), split_heads(wk, module.n_kv_heads), rotation

    return weights


# --- nanoGPT ----------------------------------------------------------------------------------


def _nanogpt(model: nn.Module) -> list[Site]:
    sites: list[Site] = []
    for name, module in numbered(model):
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
        n = head_count(model)
        raise AdapterError(
            f"add n_heads={n} to the Layout (the count {type(model).__name__}'s config holds)"
            if n
            else "add n_heads= (the model's query head count) to the Layout: qkwatch found none on the model"
        )
    if bool(layout.qkv) == bool(layout.q or layout.k) or (not layout.qkv and not (layout.q and layout.k)):
        raise AdapterError("give the Layout either qkv=, or both q= and k= (the projections' paths, {i} for the layer)")
    if layout.qkv and layout.split not in SPLITS:
        raise AdapterError(
            f"add split='qkv', 'per_head' or 'per_kv_head' to Layout(qkv={layout.qkv!r}): the order of its rows "
            "([q; k; v], per head, or per key/value head) cannot be told from its shape"
            + (f"; {layout.split!r} is none of them" if layout.split is not None else "")
        )
    for pattern in (layout.q, layout.k, layout.qkv, layout.tap):
        if pattern and "{i}" not in pattern:
            raise AdapterError(f"put {{i}} where the layer index goes in the Layout's path {pattern!r}")
    modules = dict(model.named_modules())
    h, g = layout.n_heads, layout.n_kv_heads or layout.n_heads
    rotary = rotary_module(model)
    if layout.activations and not layout.tap and rotary:
        raise AdapterError(
            f"add tap= (the module called with q and k after RoPE) or activations=False to the Layout: {rotary} "
            "rotates queries and keys after their projections, so the projections' outputs are not what it attends"
        )
    sites: list[Site] = []
    for i in itertools.count():
        paths = layout.module_paths(i)
        if not all(p in modules for p in paths):
            break
        owner = modules[paths[0].rsplit(".", 1)[0]] if "." in paths[0] else model
        found = [modules[p] for p in paths]
        projections = (
            Projections(qkv=found[0], conv1d=layout.conv1d, split=layout.split or "qkv")
            if layout.qkv
            else Projections(*found)
        )
        tap_path = layout.tap_path(i)
        if tap_path is not None and tap_path not in modules:
            raise AdapterError(f"fix the Layout's tap=: {type(model).__name__} has no module {tap_path!r}")
        if not layout.activations:
            install: Callable[[TapFn], Callable[[], None]] | None = _no_tap
        elif tap_path:
            install = module_tap(modules[tap_path])
        else:
            install = _with_padding(owner, projections.tap(h, g))
        sites.append(projection_site(i, paths[0], owner, projections, h, g, causal=layout.causal, install_tap=install))
    if not sites:
        missing = [p for p in layout.module_paths(0) if p not in modules]
        raise AdapterError(
            f"fix the Layout's paths: {type(model).__name__} has no module {', '.join(map(repr, missing))} for layer 0"
        )
    return sites


def _no_tap(fn: TapFn) -> Callable[[], None]:
    return lambda: None


def _with_padding(
    owner: nn.Module, install: Callable[[TapFn], Callable[[], None]]
) -> Callable[[TapFn], Callable[[], None]]:
    """A tap on the projections' outputs that also hands on the ``attention_mask=`` the attention
    module was called with (transformers' convention: 1 a real token, or an additive mask)."""

    def installed(fn: TapFn) -> Callable[[], None]:
        held: dict[str, Tensor] = {}

        def before(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            mask = kwargs.get("attention_mask")
            held.clear()
            if isinstance(mask, Tensor):
                held["mask"] = mask

        def tapped(
            q: Tensor, k: Tensor, mask: Tensor | None = None, causal: bool | None = None, scoring: Any = None
        ) -> None:
            fn(q, k, held.get("mask", mask), causal, scoring)

        tapped.wanted = wanted(fn)  # type: ignore[attr-defined]
        handle = owner.register_forward_pre_hook(before, with_kwargs=True)
        remove = install(tapped)

        def undo() -> None:
            handle.remove()
            remove()

        return undo

    return installed


FINDERS: tuple[Callable[[nn.Module], list[Site]], ...] = (
    _qkwatch_gpt,
    _huggingface,
    frameworks.deepseek_mla,
    _nanogpt,
    frameworks.torchtitan,
    frameworks.litgpt,
    frameworks.megatron,
)
"""The adapters :func:`find_sites` tries, in order; the first that finds a layer wins."""
