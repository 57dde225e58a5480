"""Sinks: qkwatch's layers in the tracker a team already watches (TensorBoard, W&B, MLflow).

    qkwatch.attach(model, project="p", run="r1", sinks=["tensorboard"])          # beside the collector
    qkwatch.attach(model, url=None, sinks=[TensorBoardSink("runs/r1"), "wandb"])  # without one

A sink is an object implementing :class:`qkwatch.agent.sinks.base.Sink`, or one of the names in
:data:`NAMES`, resolved here, lazily, to that sink with its defaults; a missing library is one
``ImportError`` naming the extra to install (``pip install 'qkwatch[tensorboard]'``). The agent
hands every report it spools to one worker thread (:mod:`qkwatch.agent.sinks.worker`), which calls
the sinks off the training thread; :mod:`qkwatch.agent.sinks.config` holds the settings.

Here: what a sink is (``base``), the worker (``worker``), the alerts it judges locally
(``alerts``), the heatmaps' history (``history``) and picture (``png``), and the sinks
(``tensorboard_sink``, ``wandb_sink``, ``mlflow_sink``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from qkwatch.agent.sinks.base import Sink

NAMES: dict[str, tuple[str, str, str]] = {
    "tensorboard": ("qkwatch.agent.sinks.tensorboard_sink", "TensorBoardSink", "tensorboard"),
    "wandb": ("qkwatch.agent.sinks.wandb_sink", "WandbSink", "wandb"),
    "mlflow": ("qkwatch.agent.sinks.mlflow_sink", "MlflowSink", "mlflow"),
}
"""A sink's name -> (its module, its class, the extra that installs its library)."""


def resolve(sink: Sink | str) -> Sink:
    """A sink given by name, made with its defaults (a sink object is returned as it is).

    Raises:
        ValueError: an unknown name.
        ImportError: the sink's library is not installed; the message names the extra.
    """
    if not isinstance(sink, str):
        return sink
    name = sink.strip().lower()
    if name not in NAMES:
        raise ValueError(f"unknown sink {sink!r} (known: {', '.join(NAMES)})")
    module, cls, extra = NAMES[name]
    try:
        return cast("Sink", getattr(importlib.import_module(module), cls)())
    except ImportError as exc:
        if f"qkwatch[{extra}]" in str(exc):
            raise
        raise ImportError(f"the {name} sink needs {exc.name or extra}: pip install 'qkwatch[{extra}]'") from exc
