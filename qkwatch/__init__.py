"""qkwatch: see, and act on, what attention is doing inside a model while it trains.

    import qkwatch

    with qkwatch.attach(model, project="p", run="r1") as agent:     # in the training process
        for step in range(steps):
            agent.step(step)
            ...

    runs = qkwatch.Client("http://127.0.0.1:8000").runs()           # anywhere: the collector's REST API
    reports = qkwatch.read_reports(".qkwatch/spool/p/r1")            # a run's spool on disk, no collector

The public names load on first use, so ``import qkwatch`` needs neither torch nor the collector's
dependencies until a name that uses them is touched. The parts live under this package:
``qkwatch.agent`` (in-process), ``qkwatch.monitor`` (the collector), ``qkwatch.trainer`` (the
FSDP2 GPT trainer with RAA).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from qkwatch.agent import Agent, AgentConfig, Layout, attach
    from qkwatch.client.rest import Client, CollectorError
    from qkwatch.contract.offline_reports import SpoolReports, read_reports
    from qkwatch.contract.scheduling import ScheduleConfig
    from qkwatch.contract.thresholds import Thresholds

__all__ = [
    "Agent",
    "AgentConfig",
    "Client",
    "CollectorError",
    "Layout",
    "ScheduleConfig",
    "SpoolReports",
    "Thresholds",
    "__version__",
    "attach",
    "read_reports",
]

_LAZY = {
    "attach": "qkwatch.agent",
    "Agent": "qkwatch.agent",
    "AgentConfig": "qkwatch.agent",
    "Layout": "qkwatch.agent",
    "Client": "qkwatch.client.rest",
    "CollectorError": "qkwatch.client.rest",
    "ScheduleConfig": "qkwatch.contract.scheduling",
    "read_reports": "qkwatch.contract.offline_reports",
    "SpoolReports": "qkwatch.contract.offline_reports",
    "Thresholds": "qkwatch.contract.thresholds",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qkwatch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
