"""The digests a qkwatch-gpt export carries: one sha256 per tensor (written by the trainer, checked by
the trainer's ``qkwatch eval`` and by ``qkwatch analyze``). Pure: tensors in, text out."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor


def tensor_sha256(tensor: Tensor) -> str:
    """The sha256 of a tensor's bytes (in its dtype, row-major)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def export_fault(tensors: Mapping[str, Tensor], sums: object) -> str | None:
    """What is wrong with ``tensors`` against their ``sha256`` list ``sums`` (a name -> digest dict), or None."""
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        return "its sha256 list does not name exactly the model's tensors"
    for name, tensor in tensors.items():
        if tensor_sha256(tensor) != sums[name]:
            return f"tensor {name} differs from its sha256 (the file is corrupted or was changed)"
    return None
