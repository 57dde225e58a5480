"""What identifies a layer's weights' values without a weight pass (the probe's cache of them)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def version_key(weights: tuple[Tensor | None, ...], spectra: bool) -> tuple[object, ...] | None:
    """What tells these weights' values apart from those measured last time, far cheaper than the
    weight pass: for views of parameters, the parameter, its storage, the view's place in it, the
    version counter that every tracked in-place update bumps, and a float64 sum and norm of the view
    (an update through ``.data`` bumps no version counter; it moves the sum and norm). None, measure
    again: a weight that is not a view of a parameter (computed weights such as a LoRA sum are new
    tensors every time), or not on the CPU (comparing the sums would wait for the device)."""
    key: list[object] = [spectra]
    for w in weights:
        if w is None:
            key.append(None)
            continue
        base = w if isinstance(w, nn.Parameter) else w._base
        if not isinstance(base, nn.Parameter) or w.device.type != "cpu":
            return None
        with torch.no_grad():
            sums = (w.sum(dtype=torch.float64).item(), torch.linalg.vector_norm(w, dtype=torch.float64).item())
        key.append((id(base), base.data_ptr(), w._version, w.storage_offset(), tuple(w.shape), w.stride(), sums))
    return tuple(key)
