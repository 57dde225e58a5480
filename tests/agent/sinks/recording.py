"""Sinks for the worker's tests: real objects implementing ``Sink`` that record, raise or block."""

from __future__ import annotations

import threading
from typing import Any

from qkwatch.agent.sinks.base import RunInfo, SinkAlert, SinkReport


class Recorder:
    """Keeps every call it gets."""

    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self.opened: list[RunInfo] = []
        self.reports: list[SinkReport] = []
        self.heatmaps: list[tuple[str, list[int], list[list[float | None]], int]] = []
        self.alerts: list[SinkAlert] = []
        self.closed = 0

    def open(self, run: RunInfo) -> None:
        self.opened.append(run)

    def write(self, report: SinkReport) -> None:
        self.reports.append(report)

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        self.heatmaps.append((metric, steps, layers, step))

    def alert(self, alert: SinkAlert) -> None:
        self.alerts.append(alert)

    def close(self) -> None:
        self.closed += 1


class Boom(Recorder):
    """Raises from every call, after counting it."""

    def __init__(self) -> None:
        super().__init__("boom")
        self.calls = 0

    def open(self, run: RunInfo) -> None:
        self.calls += 1
        raise RuntimeError("cannot open")

    def write(self, report: SinkReport) -> None:
        self.calls += 1
        super().write(report)
        raise RuntimeError("disk on fire")


class Blocker(Recorder):
    """Its first write never returns until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__("blocker")
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, report: SinkReport) -> None:
        self.entered.set()
        self.release.wait()
        super().write(report)


def wire(step: int, qkai: list[Any] | None = None, **scalars: float) -> dict[str, Any]:
    """An encoded report as the agent hands it over."""
    layers = {"qkai": qkai} if qkai is not None else {}
    return {"step": step, "time": 1.0e9 + step, "layers": layers, "scalars": dict(scalars)}
