"""The in-process agent: attach to a transformer, measure its attention geometry cheaply, ship it
without ever blocking a step or losing a report, and read the per-layer lambdas back.

    import qkwatch
    with qkwatch.attach(model, project="p", run="r1") as a:     # qkwatch.attach is this package's attach
        for step in range(steps):
            a.step(step)
            ...

The heavy modules load on first use, so ``import qkwatch.agent`` (and the ``qkwatch`` command) stay light.

Here: the agent and its report's path (``agent``, ``assembly``, ``report``, ``host_copy``,
``delivery``), its settings, run identity, health counters and commands; in the subpackages, where
a model keeps its attention (``models``), the hooks that measure it (``probe``), the spool and its
sender (``shipping``), the RAA weights (``lambdas``), the pure math (``metrics``) and
``qkwatch analyze`` (``offline``).

The trainer meets the agent here and in :mod:`qkwatch.agent.metrics` only (``qkwatch/trainer/reporting/monitoring.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers
    from torch import nn

    from qkwatch.agent.agent import Agent
    from qkwatch.agent.models.adapters import Site
    from qkwatch.agent.models.layouts import Layout
    from qkwatch.agent.sinks.base import RunInfo, Sink, SinkAlert, SinkReport, layer_tag, scalar_tag

__all__ = [
    "Agent",
    "AgentConfig",
    "Layout",
    "Mapping",
    "RunInfo",
    "ScheduleConfig",
    "Sink",
    "SinkAlert",
    "SinkReport",
    "Site",
    "attach",
    "exception_reason",
    "find_sites",
    "layer_tag",
    "scalar_tag",
]
_SINK_NAMES = frozenset({"RunInfo", "Sink", "SinkAlert", "SinkReport", "layer_tag", "scalar_tag"})
"""What a sink is and how it names values (``qkwatch.agent.sinks.base``), for sinks written outside the agent."""


def attach(model: Any, **kwargs: Any) -> Any:
    """See :func:`qkwatch.agent.agent.attach`."""
    from qkwatch.agent.agent import attach as _attach

    return _attach(model, **kwargs)


def exception_reason(exc: BaseException) -> str:
    """See :func:`qkwatch.agent.agent.exception_reason`: the status reason a run that raised reports."""
    from qkwatch.agent.agent import exception_reason as _exception_reason

    return _exception_reason(exc)


def find_sites(model: nn.Module, layout: Layout | None = None) -> list[Site]:
    """The attention layers of ``model`` the agent measures, in layer order, found as :func:`attach` finds them.

    Each :class:`Site` gives the layer's per-head ``wq (H, D, hs)`` and ``wk (G, D, hs)`` through
    ``site.weights()``: views of the model's own parameters, so a loss built on them
    (``qkwatch.raa.par_loss``) reaches the projections' gradients. See
    :func:`qkwatch.agent.models.adapters.find_sites`.

    Raises:
        qkwatch.agent.models.adapters.AdapterError: no attention found, or a layout that does not fit.
    """
    from qkwatch.agent.models.adapters import find_sites as _find_sites

    return _find_sites(model, layout)


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from qkwatch.agent.agent import Agent

        return Agent
    if name == "AgentConfig":
        from qkwatch.agent.config import AgentConfig

        return AgentConfig
    if name == "ScheduleConfig":  # the entropy-floor schedule's parameters, shared with the collector
        from qkwatch.contract.scheduling import ScheduleConfig

        return ScheduleConfig
    if name == "Site":  # one attention layer as the agent sees it (weights, tap, head counts)
        from qkwatch.agent.models.adapters import Site

        return Site
    if name in ("Layout", "Mapping"):  # Mapping: the older name of an explicit layout
        from qkwatch.agent.models.layouts import Layout

        return Layout
    if name in _SINK_NAMES:
        from qkwatch.agent.sinks import base

        return getattr(base, name)
    raise AttributeError(f"module 'qkwatch.agent' has no attribute {name!r}")
