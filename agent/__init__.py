"""The in-process agent: attach to a transformer, measure its attention geometry cheaply, ship it
without ever blocking a step or losing a report, and read the per-layer lambdas back.

    import qkwatch
    with qkwatch.attach(model, project="p", run="r1") as a:     # qkwatch.attach is this package's attach
        for step in range(steps):
            a.step(step)
            ...

The heavy modules load on first use, so ``import qkwatch.agent`` (and the ``qkwatch`` command) stay light.
The trainer meets the agent here and in :mod:`qkwatch.agent.metrics` only (``trainer/monitoring.py``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Agent", "AgentConfig", "Layout", "Mapping", "ScheduleConfig", "attach", "exception_reason"]


def attach(model: Any, **kwargs: Any) -> Any:
    """See :func:`qkwatch.agent.agent.attach`."""
    from qkwatch.agent.agent import attach as _attach

    return _attach(model, **kwargs)


def exception_reason(exc: BaseException) -> str:
    """See :func:`qkwatch.agent.agent.exception_reason`: the status reason a run that raised reports."""
    from qkwatch.agent.agent import exception_reason as _exception_reason

    return _exception_reason(exc)


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from qkwatch.agent.agent import Agent

        return Agent
    if name == "AgentConfig":
        from qkwatch.agent.config import AgentConfig

        return AgentConfig
    if name == "ScheduleConfig":  # the entropy-floor schedule's parameters, shared with the collector
        from qkwatch.monitor.scheduling import ScheduleConfig

        return ScheduleConfig
    if name in ("Layout", "Mapping"):  # Mapping: the older name of an explicit layout
        from qkwatch.agent.layouts import Layout

        return Layout
    raise AttributeError(f"module 'qkwatch.agent' has no attribute {name!r}")
