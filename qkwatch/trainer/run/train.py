"""Training: ``run()`` is a loop of named steps (the command line is ``qkwatch.trainer.cli``).

    torchrun --nproc_per_node 2 -m qkwatch.trainer --recipe debug_cpu [--set key=value ...] [--out DIR] [--resume]

``setup`` (``trainer.run.setup``) builds the :class:`~qkwatch.trainer.run.setup.Run` the steps share.
Each optimizer step: ``monitor.step`` -> ``apply_lambdas`` (RAA) -> ``interventions.before_step``
-> ``train_step`` (``trainer.run.step``: forward, loss with the RAA penalty and any intervention's term,
backward, clip, AdamW) -> ``maybe_intervene`` (seed 001's weight surgery) -> ``log_step`` ->
``maybe_log_qkai`` -> ``maybe_validate`` (``trainer.run.step_report``) -> ``maybe_checkpoint``. A SIGTERM
(preemption, ``trainer.run.preemption``) makes every rank checkpoint and stop at the next log step. What
a run writes, in ``--out``: ``run.json`` (the collector run's name and attempts), ``config.json``,
``metrics.jsonl`` (rank 0, every ``train.log_every`` steps: ``trainer.reporting.metrics_log``),
``checkpoints/step-N/`` (DCP) and ``model.pt`` (the qkwatch-gpt export).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from qkwatch.trainer.checkpoints.checkpoint import export_model
from qkwatch.trainer.reporting.monitoring import Monitor, crash_reason
from qkwatch.trainer.run.config import RunConfig
from qkwatch.trainer.run.parallelize import close_distributed, init_distributed
from qkwatch.trainer.run.preemption import Preemption
from qkwatch.trainer.run.setup import Run, setup
from qkwatch.trainer.run.step import train_step
from qkwatch.trainer.run.step_report import log_step, maybe_log_qkai, maybe_validate

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


def maybe_intervene(r: Run, steps_done: int) -> None:
    if r.cfg.intervention.kind != "none":
        r.interventions.after_step(steps_done)


def maybe_checkpoint(r: Run, steps_done: int, last: bool) -> None:
    if r.checkpointer.due(steps_done, last) and steps_done > r.start_step:
        r.checkpointer.save(steps_done, r.model, r.optimizer, local_state=r.monitor.state_dict())


def finish(r: Run, steps_done: int) -> None:
    if steps_done == r.total_steps and r.cfg.checkpoint.export:
        meta = {"step": steps_done, "run": r.run_name, "recipe": r.cfg.recipe, "seed": r.cfg.seed}
        export_model(r.model, r.out_dir / "model.pt", meta=meta)
        if r.env.is_main:
            logger.info("exported %s", r.out_dir / "model.pt")
