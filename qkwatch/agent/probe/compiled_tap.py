"""The probe's tap as one opaque custom op (``qkwatch::tap``), for compiled forwards.

Traced into a graph, a tap is this op: no graph break, no guard on the probe's plan. At run time
the op calls the registered Python function with the real queries and keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkwatch.agent.models.sites import Scoring, TapFn

_TAPS: dict[int, TapFn] = {}
_SINKS: dict[str, Tensor] = {}
_NEXT = [0]


def register_tap(fn: TapFn) -> int:
    _NEXT[0] += 1
    _TAPS[_NEXT[0]] = fn
    return _NEXT[0]


def sink(device: torch.device) -> Tensor:
    """A one-element tensor the op declares it mutates, so that no compiler drops the call."""
    key = str(device)
    if key not in _SINKS:
        _SINKS[key] = torch.zeros(1, device=device)
    return _SINKS[key]


@torch.library.custom_op("qkwatch::tap", mutates_args=("sink",))
def tap_op(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    causal: bool | None,
    scale: float | None,
    softcap: float | None,
    sink: Tensor,
    token: int,
) -> None:
    fn = _TAPS.get(token)
    if fn is not None:
        fn(q, k, mask, causal, Scoring(scale, softcap) if scale is not None or softcap is not None else None)


@tap_op.register_fake
def _(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    causal: bool | None,
    scale: float | None,
    softcap: float | None,
    sink: Tensor,
    token: int,
) -> None:
    return None


def unregister_tap(token: int) -> None:
    _TAPS.pop(token, None)
