"""AdamW, the warmup + cosine (or constant) learning rate, and gradient clipping that works on FSDP2 shards."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

SCHEDULES = ("cosine", "constant")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    schedule: str = "cosine"
    """cosine (linear warmup, cosine decay to min_lr_ratio * lr) or constant (after warmup)."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many steps."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay, relative to lr."""
    beta1: float = 0.9
    """AdamW beta_1."""
    beta2: float = 0.95
    """AdamW beta_2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases, gates or Householder vectors)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping; the norm is still reported)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optim.{key} must lie in [0, 1), got {getattr(self, key)}")
        for key in ("eps", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ValueError(f"optim.{key} must be >= 0, got {getattr(self, key)}")


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and not name.endswith("key_rotation.vectors") else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


def lr_at(step: int, total_steps: int, config: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (from 0): a pure function, so resuming needs no state."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Global gradient norm over all shards, and clipping to ``max_norm`` (0: report only).

    With FSDP2 the gradients are DTensor shards: the norm of the whole model needs their partial
    norms reduced over the ranks (``full_tensor``), as torchtitan does.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]  # all of them; the test narrows the type
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
