"""The monitoring seam between the training loop and the in-process agent.

``train.py`` talks to a monitor through :class:`Monitor`. The agent provides one with
``agent.attach(model, config=..., run=..., project=...)``; :func:`open_monitor` attaches it when
``QKWATCH_URL`` is set and falls back to :class:`NullMonitor` otherwise.

Per optimizer step the loop calls, in this order: ``step(step)`` before the forward,
``lambdas()`` (RAA only), then ``log(step, ...)`` and ``log_layers(step, ...)`` with device
tensors it does not synchronise; ``close(timeout)`` once at the end (idempotent).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

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

    def close(self, timeout: float = 10.0) -> None:
        """Flush what can be flushed within ``timeout`` seconds; idempotent."""


class NullMonitor:
    """A monitor that gives no advice and keeps nothing."""

    def step(self, step: int) -> None:
        pass

    def lambdas(self) -> list[float] | None:
        return None

    def log(self, step: int, **scalars: float | Tensor) -> None:
        pass

    def log_layers(self, step: int, values: dict[str, list[float] | Tensor]) -> None:
        pass

    def close(self, timeout: float = 10.0) -> None:
        pass


def open_monitor(
    model, *, config: dict[str, Any], run: str | None, project: str | None, every: int | None = None
) -> Monitor:
    """The agent when ``QKWATCH_URL`` is set, else a :class:`NullMonitor`.

    ``run``, ``project`` and ``every`` (the report cadence) are passed only when given, so that
    the agent's own environment settings (``QKWATCH_RUN``...) apply otherwise.
    """
    if not os.environ.get("QKWATCH_URL"):
        return NullMonitor()
    from agent import attach

    kwargs: dict[str, Any] = {"config": config, "run": run, "project": project, "every": every}
    return attach(model, **{k: v for k, v in kwargs.items() if v is not None})
