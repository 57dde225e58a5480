"""Rotary position embeddings (RoPE, rotate-half layout): the cos/sin cache and its application."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cache(seq_len: int, d_head: int, theta: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, d/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (T, d)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (B, h, T, d)`` by position (rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
