"""What the loop reports after a step: the step's values (:func:`log_step`, every step to the monitor,
every ``train.log_every`` a log line and a ``metrics.jsonl`` record), per-layer QKAI from the weights
(:func:`maybe_log_qkai`) and the validation loss (:func:`maybe_validate`)."""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from qkwatch.agent.metrics import qkai, split_heads
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.init import full_tensor
from qkwatch.trainer.run.setup import Run
from qkwatch.trainer.run.step import StepStats

logger = logging.getLogger(__name__)


def log_step(r: Run, step: int, stats: StepStats, lambdas: list[float]) -> None:
    """Hand the step's values to the monitor (device tensors, no sync); every log_every, one sync and a line."""
    r.monitor.log(step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm, par=stats.par)
    flagged = sum(r.cfg.raa.schedule.flagged(lambdas)) if r.cfg.raa.uses_par else 0
    if r.cfg.raa.uses_par:
        r.monitor.log(step, raa_flagged_fraction=flagged / len(lambdas))
        r.monitor.log_layers(step, {"lambda": list(lambdas), "par": stats.par_layers})
    last = step + 1 == r.total_steps
    if (step + 1) % r.cfg.train.log_every and not last and step != r.start_step:
        return
    signal_seen = torch.tensor(float(r.preemption.requested), device=stats.loss.device)
    values = torch.stack(
        [
            stats.loss.float(),
            stats.par.float(),
            stats.grad_norm.float().to(stats.loss.device),
            signal_seen * r.env.world_size,
        ]
    )
    if r.env.distributed:  # every rank reaches this at the same steps
        dist.all_reduce(values)
        values /= r.env.world_size
    loss, par, grad_norm, signals = values.tolist()  # the one device sync of this step
    r.stop_requested = signals > 0
    r.last_loss = loss
    now = time.perf_counter()
    tokens = (step + 1 - r.tick_step) * r.cfg.train.global_batch_size * r.cfg.seq_len
    tokens_per_s = tokens / max(now - r.tick, 1e-9)
    r.tick, r.tick_step = now, step + 1
    if not r.env.is_main:
        return
    logger.info(
        "step %d/%d  loss %.4f  par %.3g  grad_norm %.3f  lr %.2e  flagged %d/%d  %.0f tok/s",
        step,
        r.total_steps,
        loss,
        par,
        grad_norm,
        stats.lr,
        flagged,
        len(lambdas),
        tokens_per_s,
    )
    record = {
        "step": step,
        "loss": loss,
        "par": par,
        "grad_norm": grad_norm,
        "lr": stats.lr,
        "lambda": list(lambdas),
        "flagged": flagged,
        "lambda_source": r.lambda_source,
        "tokens_per_s": tokens_per_s,
        "time": time.time(),
    }
    if r.env.device.type == "cuda":
        record["max_memory_gib"] = torch.cuda.max_memory_allocated(r.env.device) / 2**30
    r.metrics.append(record)


def maybe_log_qkai(r: Run, steps_done: int) -> None:
    """Per-layer QKAI from the weights, so that a band shows without a collector (collective under FSDP2),
    at the step whose forward runs with them (the next one), as the agent numbers its reports."""
    every = r.cfg.train.qkai_every
    if not every or (steps_done % every and steps_done != r.total_steps and steps_done != r.start_step + 1):
        return
    values = layer_qkai(r.model).tolist()
    if r.env.is_main:  # the weights step `steps_done`'s forward runs with, as the agent reports them
        logger.info("step %d  qkai by layer: %s", steps_done, " ".join(f"{v:.2f}" for v in values))
        r.metrics.append({"step": steps_done, "qkai": values})


@torch.no_grad()
def layer_qkai(model: GPT) -> Tensor:
    """``(n_layers,)`` mean QKAI over heads (the key rotation and sigma-Reparam leave the subspaces unchanged)."""
    values = []
    for attn in model.attentions():
        wq = split_heads(full_tensor(attn.q_proj.weight).float(), attn.n_heads)  # (nh, D, hs)
        wk = split_heads(full_tensor(attn.k_proj.weight).float(), attn.n_kv_heads)  # (nkv, D, hs)
        values.append(qkai(wq, wk).mean())
    return torch.stack(values).cpu()


def maybe_validate(r: Run, steps_done: int) -> None:
    every = r.cfg.train.val_every
    if steps_done == r.total_steps or (every and steps_done % every == 0):
        r.last_val = validation_loss(r)
        r.monitor.log(steps_done - 1, val_loss=r.last_val)
        if r.env.is_main:
            logger.info(
                "step %d  val_loss %.4f  (%.3f bits/byte)", steps_done - 1, r.last_val, r.last_val / math.log(2)
            )
            r.metrics.append({"step": steps_done - 1, "val_loss": r.last_val})


@torch.no_grad()
def validation_loss(r: Run) -> float:
    """Mean next-token loss on fixed validation windows, shared out over the ranks."""
    r.model.eval()
    windows = r.data.val_windows(r.cfg.train.val_batches * r.env.world_size, r.cfg.seq_len)
    mine = windows[r.env.rank :: r.env.world_size].to(r.env.device)
    total = torch.zeros(2, device=r.env.device)
    for row in torch.split(mine, r.micro_batch):
        with r.env.autocast():
            logits = r.model(row[:, :-1]).logits
        total[0] += F.cross_entropy(logits.float().flatten(0, 1), row[:, 1:].flatten(), reduction="sum")
        total[1] += row[:, 1:].numel()
    if r.env.distributed:
        dist.all_reduce(total)
    r.model.train()
    return (total[0] / total[1]).item()
