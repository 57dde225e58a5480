"""Training: ``run()`` is a loop of named steps (the command line is ``qkwatch.trainer.cli``).

    torchrun --nproc_per_node 2 -m qkwatch.trainer --recipe debug_cpu [--set key=value ...] [--out DIR] [--resume]

Each optimizer step: ``monitor.step`` -> ``apply_lambdas`` (RAA) -> ``interventions.before_step``
-> ``train_step`` (forward, loss with the RAA penalty and any intervention's term, backward, clip,
AdamW) -> ``maybe_intervene`` (seed 001's weight surgery) ->
``log_step`` -> ``maybe_log_qkai`` -> ``maybe_validate`` -> ``maybe_checkpoint``. A SIGTERM
(preemption) makes every rank checkpoint and stop at the next log step. What a run writes, in ``--out``:
``run.json`` (the collector run's name and attempts), ``config.json``, ``metrics.jsonl`` (rank 0,
every ``train.log_every`` steps: ``trainer.metrics_log``), ``checkpoints/step-N/`` (DCP) and
``model.pt`` (the qkwatch-gpt export).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from qkwatch.agent.metrics import qkai, split_heads
from qkwatch.trainer.checkpoint import Checkpointer, export_model
from qkwatch.trainer.config import RunConfig
from qkwatch.trainer.data import TrainData
from qkwatch.trainer.init import build_model, full_tensor
from qkwatch.trainer.interventions import Interventions
from qkwatch.trainer.metrics_log import MetricsLog
from qkwatch.trainer.model import GPT
from qkwatch.trainer.monitoring import Monitor, crash_reason, open_monitor
from qkwatch.trainer.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from qkwatch.trainer.parallelize import Env, close_distributed, init_distributed, parallelize
from qkwatch.trainer.raa import RAAController

logger = logging.getLogger(__name__)

MONITOR_CLOSE_TIMEOUT_S = 10.0
LAMBDA_SOURCES = {
    "collector": "the collector's entropy-floor schedule",
    "local": "the agent's local entropy-floor schedule (no collector, or it is away)",
    "fixed": "raa.fallback_lambdas (scheduling off)",
    None: "raa.fallback_lambdas: the monitor gives none",
}


@dataclass
class TrainResult:
    """What a finished (or stopped) run reports back."""

    out_dir: Path
    run_name: str
    steps: int
    """Optimizer steps done."""
    loss: float
    """Training loss of the last logged step."""
    val_loss: float | None


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


@dataclass
class Run:
    """Everything the loop's steps share."""

    cfg: RunConfig
    env: Env
    out_dir: Path
    run_name: str
    model: GPT
    optimizer: torch.optim.Optimizer
    data: TrainData
    raa: RAAController
    interventions: Interventions
    checkpointer: Checkpointer
    monitor: Monitor
    metrics: MetricsLog
    """``metrics.jsonl``; rank 0 writes it."""
    total_steps: int
    micro_batch: int
    accumulation: int
    start_step: int = 0
    preemption: Preemption = field(default_factory=lambda: Preemption(install=False))
    stop_requested: bool = False
    """Some rank got SIGTERM: every rank learns it at the same log step, checkpoints and stops."""
    last_loss: float = math.nan
    last_val: float | None = None
    lambda_source: str | None = "unset"
    """Where RAA's lambdas came from at the last step (see ``note_lambda_source``)."""
    tick: float = field(default_factory=time.perf_counter)
    tick_step: int = 0


# --- the loop ------------------------------------------------------------------------------------


def run(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    monitor: Monitor | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``out_dir``.

    Args:
        resume: continue from the latest checkpoint in ``out_dir`` (a fresh start if there is none).
        monitor: use this monitor instead of attaching the agent (``open_monitor``).
        stop_after: stop (with a checkpoint) once this many steps are done, as a preemption would.
    """
    env = init_distributed(cfg.parallel)
    r = None
    end: tuple[str, str | None] = ("crashed", None)
    try:
        r = setup(cfg, env, Path(out_dir), resume, monitor)
        r.preemption = Preemption()
        step = r.start_step
        while step < r.total_steps:
            r.monitor.step(step)
            lambdas = apply_lambdas(r, step)
            r.interventions.before_step(step)
            stats = train_step(r, step, lambdas)
            maybe_intervene(r, step + 1)
            log_step(r, step, stats, lambdas)
            step += 1
            stopping = (stop_after is not None and step >= stop_after) or r.stop_requested
            if r.stop_requested:
                logger.warning("SIGTERM: checkpointing step %d and stopping; continue with --resume", step)
            maybe_log_qkai(r, step)
            maybe_validate(r, step)
            maybe_checkpoint(r, step, last=step == r.total_steps or stopping)
            if stopping:
                break
        finish(r, step)
        end = end_status(r, step, stop_after)
        return TrainResult(r.out_dir, r.run_name, step, r.last_loss, r.last_val)
    except BaseException as exc:
        end = ("crashed", crash_reason(exc))
        raise
    finally:
        if r is not None:
            r.preemption.close()
            r.monitor.close(MONITOR_CLOSE_TIMEOUT_S, status=end[0], reason=end[1])
        close_distributed(env)


def end_status(r: Run, steps_done: int, stop_after: int | None) -> tuple[str, str | None]:
    """How a run that returned ended: finished when every step is done, else why it stopped early."""
    if steps_done >= r.total_steps:
        return "finished", f"all {r.total_steps} steps done"
    if r.stop_requested:
        return "crashed", f"preempted: SIGTERM at step {steps_done}, checkpointed; continue with --resume"
    return "crashed", f"stopped: stop_after={stop_after} at step {steps_done}, checkpointed; continue with --resume"


def setup(cfg: RunConfig, env: Env, out_dir: Path, resume: bool, monitor: Monitor | None) -> Run:
    """Model, optimizer, data, RAA, interventions, checkpoint and monitor, in that order."""
    checkpointer = Checkpointer(out_dir / "checkpoints", cfg.checkpoint)
    latest = checkpointer.latest()
    if latest is not None and not resume:
        raise ValueError(f"{out_dir} holds checkpoints of an earlier run: pass --resume, or another --out")
    torch.manual_seed(cfg.seed)
    model = build_model(
        cfg.model_config(), cfg.init, cfg.seed, env.device, parallelize=lambda m: parallelize(m, cfg.parallel, env)
    )
    optimizer = build_optimizer(model, cfg.optim)
    data = TrainData(cfg.data, cfg.seq_len, cfg.train.global_batch_size, cfg.seed)
    interventions = Interventions(cfg.intervention, model, data.steps_per_epoch, cfg.seed)
    start = checkpointer.load(latest, model, optimizer) if latest is not None else 0
    total = cfg.train.steps if cfg.train.epochs is None else math.ceil(cfg.train.epochs * data.steps_per_epoch)
    micro, accum = cfg.train.accumulation(env.world_size)
    run_name = resolve_run_name(cfg, out_dir, env, resumed=latest is not None)
    metrics = MetricsLog(out_dir / "metrics.jsonl")
    write_run_files(cfg, out_dir, env, run_name, start, metrics)
    monitor = monitor or open_monitor(
        model,
        config=cfg.to_dict(),
        run=run_name,
        project=cfg.project,
        every=cfg.train.report_every,
        offline_spool=out_dir / "spool" if cfg.raa.uses_schedule else None,
    )
    if latest is not None:
        monitor.load_state_dict(checkpointer.local_states(latest))
    raa = RAAController(cfg.raa, model.attentions())
    logger.info(
        "%s: %s params, %d layers, variant %s, RAA %s, %d steps of %d x %d tokens on %d rank(s), out %s",
        cfg.recipe,
        f"{sum(p.numel() for p in model.parameters()):,}",
        cfg.model.n_layers,
        cfg.model.variant,
        "on" if cfg.raa.enabled else "off",
        total,
        cfg.train.global_batch_size,
        cfg.seq_len,
        env.world_size,
        out_dir,
    )
    return Run(
        cfg,
        env,
        out_dir,
        run_name,
        model,
        optimizer,
        data,
        raa,
        interventions,
        checkpointer,
        monitor,
        metrics,
        total,
        micro,
        accum,
        start_step=start,
        tick_step=start,
    )


def apply_lambdas(r: Run, step: int) -> list[float]:
    """Read this step's per-layer PAR weights (or the fallback) and flag the layers above the floor."""
    if not r.cfg.raa.uses_par:
        return [0.0] * r.raa.n_layers
    lambdas = r.raa.lambdas(r.monitor)
    r.raa.apply(lambdas, step)
    note_lambda_source(r, step)
    return lambdas


def note_lambda_source(r: Run, step: int) -> None:
    """Say in the log where RAA's lambdas come from, at the start and whenever that changes."""
    source = r.monitor.lambda_source if r.cfg.raa.scheduling else "fixed"
    if source == r.lambda_source:
        return
    r.lambda_source = source
    if r.env.is_main:
        logger.info("step %d  RAA lambdas from %s", step, LAMBDA_SOURCES.get(source, source))


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


def maybe_intervene(r: Run, steps_done: int) -> None:
    if r.cfg.intervention.kind != "none":
        r.interventions.after_step(steps_done)


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
    """Per-layer QKAI from the weights, so that a band shows without a collector (collective under FSDP2)."""
    every = r.cfg.train.qkai_every
    if not every or (steps_done % every and steps_done != r.total_steps and steps_done != r.start_step + 1):
        return
    values = layer_qkai(r.model).tolist()
    if r.env.is_main:
        logger.info("step %d  qkai by layer: %s", steps_done - 1, " ".join(f"{v:.2f}" for v in values))
        r.metrics.append({"step": steps_done - 1, "qkai": values})


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


def maybe_checkpoint(r: Run, steps_done: int, last: bool) -> None:
    if r.checkpointer.due(steps_done, last) and steps_done > r.start_step:
        r.checkpointer.save(steps_done, r.model, r.optimizer, local_state=r.monitor.state_dict())


def finish(r: Run, steps_done: int) -> None:
    if steps_done == r.total_steps and r.cfg.checkpoint.export:
        meta = {"step": steps_done, "run": r.run_name, "recipe": r.cfg.recipe, "seed": r.cfg.seed}
        export_model(r.model, r.out_dir / "model.pt", meta=meta)
        if r.env.is_main:
            logger.info("exported %s", r.out_dir / "model.pt")


class Preemption:
    """Remembers a SIGTERM (a cluster's preemption notice) instead of dying at once; ``close`` restores.

    The loop reads ``requested`` at its log steps, where the ranks already synchronise, so they
    all stop after the same step, with a checkpoint (``--resume`` continues).
    """

    def __init__(self, install: bool = True) -> None:
        self.requested = False
        self._previous = None
        if install and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


# --- run identity and files ------------------------------------------------------------------------


def resolve_run_name(cfg: RunConfig, out_dir: Path, env: Env, resumed: bool) -> str:
    """The collector run: cfg.run_name, QKWATCH_RUN, the one in run.json (a resume), or a new one."""
    name = cfg.run_name or os.environ.get("QKWATCH_RUN")
    info = out_dir / "run.json"
    if name is None and resumed and info.is_file():
        name = json.loads(info.read_text()).get("run")
    if name is None:
        name = f"{cfg.recipe}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    if env.distributed:  # rank 0's clock decides
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


def write_run_files(cfg: RunConfig, out_dir: Path, env: Env, run_name: str, start: int, metrics: MetricsLog) -> None:
    """run.json (name, attempts), config.json, and metrics.jsonl cut back to the resumed step."""
    if not env.is_main:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    info = out_dir / "run.json"
    attempts = json.loads(info.read_text()).get("attempts", []) if info.is_file() and start > 0 else []
    attempts.append({"start_step": start, "time": time.time(), "world_size": env.world_size})
    info.write_text(
        json.dumps({"run": run_name, "project": cfg.project, "recipe": cfg.recipe, "attempts": attempts}, indent=2)
    )
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    metrics.truncate(start)
