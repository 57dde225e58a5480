"""``--sinks``: what the sinks (``qkwatch.agent.sinks``) cost the training step.

Both arms have the agent attached the same way (same cadence, same collector setting); arm A's also
sends every report to the sinks named, so the difference between the arms is the sinks' cost. The
sinks write under one temporary folder, nothing over the network:

* ``tensorboard``: ``TensorBoardSink`` (event files);
* ``wandb``: ``WandbSink`` in offline mode (W&B's own service process, its files local);
* ``mlflow``: ``MlflowSink`` on a local file store;
* ``none``: no sink in either arm, the A/A control: the difference the bench reads between two arms
  that differ in nothing.

The sinks' worker thread (``qkwatch-sinks-0``) is timed by wrapping its per-report handler: wall
clock and the thread's own CPU time (``time.thread_time``), both off the training thread; its
counters (reports written, dropped for a full queue, calls that raised) are read at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkwatch.agent import Agent
from qkwatch.agent.sinks.base import Sink

NAMES = ("tensorboard", "wandb", "mlflow")
"""The sinks ``--sinks`` knows (comma-separated)."""
CONTROL = "none"
"""``--sinks none``: both arms with the agent and neither with a sink, the A/A control (what the
bench reads when the two arms differ in nothing)."""


def parse(value: str) -> tuple[str, ...]:
    """``--sinks tensorboard,wandb`` -> ("tensorboard", "wandb"); an unknown name is argparse's error."""
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    if names == (CONTROL,):
        return names
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--sinks: {', '.join(unknown) or 'none given'} (known: {', '.join(NAMES)})")
    return names


def arms(names: tuple[str, ...]) -> str:
    """What each arm has, for the run's description."""
    if names == (CONTROL,):
        return "arms A and B: the agent alone (the A/A control)"
    return f"arm A: the agent and the sinks {', '.join(names)}, arm B: the agent alone"


def make_sinks(names: tuple[str, ...], folder: Path) -> list[Sink]:
    """The sinks named, each writing under ``folder`` (W&B offline, MLflow a file store); none for ``none``."""
    out: list[Sink] = []
    for name in names:
        if name == "tensorboard":
            from qkwatch.agent.sinks.tensorboard_sink import TensorBoardSink

            out.append(TensorBoardSink(folder / "tensorboard"))
        elif name == "wandb":
            from qkwatch.agent.sinks.wandb_sink import WandbSink

            offline_wandb(folder / "wandb")
            out.append(WandbSink(mode="offline", dir=str(folder / "wandb")))
        elif name == "mlflow":
            from qkwatch.agent.sinks.mlflow_sink import MlflowSink

            os.environ.update(MLFLOW_ALLOW_FILE_STORE="true", MLFLOW_DISABLE_TELEMETRY="true")
            out.append(MlflowSink(tracking_uri=(folder / "mlruns").as_uri()))
    return out


def offline_wandb(folder: Path) -> None:
    """W&B offline and silent, every one of its folders under ``folder`` (no API key read)."""
    os.environ.pop("WANDB_API_KEY", None)
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        path = folder / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)


class WorkerClock:
    """Cumulative seconds the sinks' worker spends handling reports: wall clock and its own CPU time.

    Only the worker thread adds; the training thread reads the totals between rounds (floats, read
    whole under the GIL), so a round's share is the difference of two readings.
    """

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - cpu
                self.wall += time.perf_counter() - wall

        return timed

    def reading(self) -> tuple[float, float]:
        return self.wall, self.cpu


def watch_worker(monitor: Agent) -> WorkerClock:
    """Time ``monitor``'s sinks' worker (its ``_handle``: an instance attribute shadows the method)."""
    clock = WorkerClock()
    worker = monitor.sinks
    if worker is not None:
        worker._handle = clock.wrap(worker._handle)  # type: ignore[method-assign]
    return clock


def worker_counts(monitor: Agent) -> dict[str, Any]:
    """The worker's counters after close: reports written, dropped, failed calls by sink, still queued."""
    worker = monitor.sinks
    if worker is None:
        return {}
    return {
        "written": worker.written,
        "dropped": worker.dropped,
        "failures": dict(worker.failures),
        "pending": worker.pending,
    }


def folder_size(folder: Path) -> int:
    """Bytes the sinks wrote under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def print_summary(s: dict[str, Any], counts: dict[str, Any], folder: Path) -> None:
    """The ``--sinks`` lines after the table: arm B's agent, the difference on the training thread,
    the sinks' worker, and whether the interval tells a cost from zero."""
    print(
        f"training thread inside arm B's agent (no sinks): {s['inside_b_ms']:.1f} ms a round, "
        f"{100 * s['share_b']:.3f} % of the round; arm A's minus arm B's: {100 * s['inside_extra']:+.3f} % "
        f"of the round, 95 % bootstrap CI [{100 * s['inside_extra_low']:+.3f} %, {100 * s['inside_extra_high']:+.3f} %]"
    )
    if not counts:
        print("no sinks' worker: the A/A control (neither arm has a sink)")
    else:
        print(
            f"the sinks' worker thread (off the training thread): {s['sinks_wall_ms']:.1f} ms a round wall clock, "
            f"{s['sinks_cpu_ms']:.1f} ms of its own CPU time; reports written {counts.get('written')}, dropped "
            f"{counts.get('dropped')}, failed calls {counts.get('failures') or 'none'}, still queued at close "
            f"{counts.get('pending')}; {folder_size(folder) / 2**20:.1f} MiB written under {folder}"
        )
    low, high = 100 * s["low"], 100 * s["high"]
    if low > 0:
        verdict = (
            f"{'arm A slower' if not counts else 'a cost'}: the interval [{low:+.2f} %, {high:+.2f} %] lies above zero"
        )
    elif high < 0:
        verdict = f"arm A was faster: the interval [{low:+.2f} %, {high:+.2f} %] lies below zero"
    else:
        verdict = (
            f"no cost told from zero: the interval [{low:+.2f} %, {high:+.2f} %] holds zero; it does not "
            f"exclude a cost up to {high:+.2f} %"
        )
    what = "arm A against arm B, neither with a sink" if not counts else "the sinks' cost to the step"
    print(f"\n{what}: {verdict}")
