"""A run's setup: :class:`Run`, everything the loop's steps share, built by :func:`setup`, and the
run's identity and files in ``--out`` (``run.json``, ``config.json``; ``metrics.jsonl`` cut back on resume)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qkwatch.trainer.checkpoints.checkpoint import Checkpointer
from qkwatch.trainer.checkpoints.safety import BadCheckpoint
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.init import build_model
from qkwatch.trainer.model.rank_anchored import RAAController
from qkwatch.trainer.reporting.metrics_log import MetricsLog
from qkwatch.trainer.reporting.monitoring import Monitor, open_monitor
from qkwatch.trainer.run.config import RunConfig
from qkwatch.trainer.run.data import TrainData
from qkwatch.trainer.run.interventions import Interventions
from qkwatch.trainer.run.optim import build_optimizer
from qkwatch.trainer.run.parallelize import Env, parallelize
from qkwatch.trainer.run.preemption import Preemption

logger = logging.getLogger(__name__)


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
    """Where RAA's lambdas came from at the last step (see ``train.note_lambda_source``)."""
    tick: float = field(default_factory=time.perf_counter)
    tick_step: int = 0


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
    local_states = checkpointer.local_states(latest) if latest is not None else []
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
        restore_monitor(monitor, local_states, checkpointer.local_state_files(latest))
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


def restore_monitor(monitor: Monitor, states: list[dict[str, Any]], files: list[Path]) -> None:
    """The monitor's state from the checkpoint; one that does not fit closes the monitor and names its files."""
    try:
        monitor.load_state_dict(states)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        monitor.close(10.0, status="crashed", reason="a bad checkpoint")
        named = ", ".join(map(str, files)) if len(files) <= 2 else f"{files[0].parent}/local-rank*.json"
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise BadCheckpoint(
            f"{named}: not a monitor state this run can restore ({type(exc).__name__}: {text})"
        ) from None


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
