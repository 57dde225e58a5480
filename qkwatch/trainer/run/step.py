"""One optimizer step: :func:`train_step` over the global batch (forward, loss with the RAA penalty
and any intervention's term, backward, clip, AdamW), and the :class:`StepStats` it hands the reports."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from qkwatch.trainer.run.optim import clip_grad_norm_, lr_at, set_lr
from qkwatch.trainer.run.setup import Run


@dataclass
class StepStats:
    loss: Tensor
    """Mean cross-entropy over the global batch's micro-batches on this rank."""
    par: Tensor
    """The PAR term added to the loss (0 when no layer was flagged)."""
    par_layers: Tensor
    """``(n_layers,)`` each layer's PAR term."""
    grad_norm: Tensor
    lr: float


def train_step(r: Run, step: int, lambdas: list[float]) -> StepStats:
    """One optimizer step over the global batch (gradient accumulation over micro-batches)."""
    model, env = r.model, r.env
    model.train()
    lr = lr_at(step, r.total_steps, r.cfg.optim)
    set_lr(r.optimizer, lr)
    attentions = r.raa.attentions
    installed = [dict(a.weight_penalties) for a in attentions]
    ce_sum = torch.zeros((), device=env.device)
    par, par_layers = None, None
    for micro in range(r.accumulation):
        if isinstance(model, FSDPModule):  # env.distributed: reduce the gradients after the last micro-batch only
            model.set_requires_gradient_sync(micro == r.accumulation - 1)
        if micro == 1:  # the weight penalties are the same for every micro-batch: once per step
            for a in attentions:
                a.weight_penalties.clear()
        start = (micro * env.world_size + env.rank) * r.micro_batch
        inputs, targets = (t.to(env.device, non_blocking=True) for t in r.data.batch(step, start, r.micro_batch))
        with env.autocast():
            out = model(inputs)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        loss = ce / r.accumulation
        if micro == 0:
            par, terms = r.raa.loss(out.penalties, lambdas)
            par_layers = torch.stack([t.detach().float() if isinstance(t, Tensor) else ce.new_zeros(()) for t in terms])
            if par is not None:
                loss = loss + par
            extra = r.interventions.loss(out.penalties)
            if extra is not None:
                loss = loss + extra
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        ce_sum += ce.detach()
    for a, pens in zip(attentions, installed, strict=True):
        a.weight_penalties.update(pens)
    grad_norm = clip_grad_norm_(model.parameters(), r.cfg.optim.grad_clip)
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    assert par_layers is not None  # micro-batch 0 always runs (accumulation >= 1)
    par_value = par.detach() if par is not None else ce_sum.new_zeros(())
    return StepStats(ce_sum / r.accumulation, par_value, par_layers, grad_norm, lr)
