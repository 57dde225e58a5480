"""The monitoring seam between the training loop and the in-process agent.

The one trainer module that uses the agent's runtime (``qkwatch.agent``'s public API); the
others import only the geometry functions of ``qkwatch.agent.metrics``. ``run/train.py`` talks to
a monitor through :class:`Monitor`; ``model/rank_anchored.py`` takes the entropy-floor schedule's
parameters, :class:`ScheduleConfig`, from here (the agent and the collector compute the lambdas with them).
The agent provides a monitor with ``qkwatch.agent.attach(model, config=..., run=..., project=...)``;
:func:`open_monitor` attaches it when ``QKWATCH_URL`` is set, or offline when RAA's entropy-floor
schedule needs the entropies it measures, and falls back to :class:`NullMonitor` otherwise.

Per optimizer step the loop calls, in this order: ``step(step)`` before the forward,
``lambdas()`` (RAA only), then ``log(step, ...)`` and ``log_layers(step, ...)`` with device
tensors it does not synchronise; ``close(timeout, status=..., reason=...)`` once at the end
(idempotent), saying how the run ended (:func:`crash_reason` words an exception).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from qkwatch.agent import ScheduleConfig

__all__ = ["Monitor", "NullMonitor", "ScheduleConfig", "crash_reason", "open_monitor"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Monitor(Protocol):
    def step(self, step: int) -> None:
        """Called once per optimizer step, before its forward."""

    def lambdas(self) -> list[float] | None:
        """Per-layer PAR weights for this step, the same on every rank; None = no advice. Never blocks."""

    def log(self, step: int, **scalars: float | Tensor) -> None:
        """Run-level scalars (loss, lr, grad norm, eval results)."""

    def log_layers(self, step: int, values: dict[str, list[float] | Tensor]) -> None:
        """Per-layer values, e.g. ``{"lambda": [...], "par": tensor}``."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state a resumed run needs (plain JSON, saved with the checkpoint)."""

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Restore from the states all ranks saved at the checkpoint being resumed."""

    @property
    def lambda_source(self) -> str | None:
        """Where ``lambdas()`` got this step's values: "collector", "local" (the same schedule computed
        in-process from the measured entropies), or None (no advice)."""

    def close(self, timeout: float = 10.0, *, status: str | None = "finished", reason: str | None = None) -> None:
        """Flush what can be flushed within ``timeout`` seconds and say how the run ended; idempotent.

        ``status``: "finished" (every step done), "crashed" (an exception, a preemption, a stop;
        ``reason`` says which), or None to say nothing.
        """


class NullMonitor:
    """A monitor that gives no advice and keeps nothing."""

    lambda_source = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        pass

    def step(self, step: int) -> None:
        pass

    def lambdas(self) -> list[float] | None:
        return None

    def log(self, step: int, **scalars: float | Tensor) -> None:
        pass

    def log_layers(self, step: int, values: dict[str, list[float] | Tensor]) -> None:
        pass

    def close(self, timeout: float = 10.0, *, status: str | None = "finished", reason: str | None = None) -> None:
        pass


def open_monitor(
    model: nn.Module,
    *,
    config: dict[str, Any],
    run: str | None,
    project: str | None,
    every: int | None = None,
    offline_spool: Path | None = None,
) -> Monitor:
    """The agent when ``QKWATCH_URL`` is set, or offline when ``offline_spool`` is given; else a :class:`NullMonitor`.

    An offline agent measures and reports as usual, into its spool (``QKWATCH_SPOOL`` if set,
    else ``offline_spool``; ``qkwatch sync`` delivers it later), and serves RAA the entropy-floor
    lambdas computed from its own entropies: the schedule runs whether or not a collector does.
    ``run``, ``project`` and ``every`` (the report cadence) are passed only when given, so that
    the agent's own environment settings (``QKWATCH_RUN``...) apply otherwise.
    """
    online = bool(os.environ.get("QKWATCH_URL"))
    if not online and offline_spool is None:
        return NullMonitor()
    from qkwatch.agent import attach

    kwargs: dict[str, Any] = {"config": config, "run": run, "project": project, "every": every}
    if not online and not os.environ.get("QKWATCH_SPOOL"):
        kwargs["spool"] = str(offline_spool)
        logger.info(
            "no collector (QKWATCH_URL unset): the agent reports into %s (deliver later with "
            "`qkwatch sync %s`) and RAA's lambdas come from its local entropy-floor schedule",
            offline_spool,
            offline_spool,
        )
    agent: Monitor = attach(model, **{k: v for k, v in kwargs.items() if v is not None})
    return agent


def crash_reason(exc: BaseException) -> str:
    """The status reason of a run that raised (the agent cuts it to what the collector keeps)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted: KeyboardInterrupt; continue from the last checkpoint with --resume"
    from qkwatch.agent import exception_reason

    return exception_reason(exc)
