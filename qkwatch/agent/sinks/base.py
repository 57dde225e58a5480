"""What a sink is: where the agent sends each report besides (or instead of) the collector.

A sink is the agent's, not the training thread's: the agent hands each encoded report to one
worker thread (``qkwatch.agent.sinks.worker``) through a bounded queue, and the worker calls every
sink in turn. A report that finds the queue full is dropped for the sinks (counted, never waited
for); a sink that raises is logged once and called again with the next report, and never stops
training or the other sinks.

The names a sink writes are the catalogue's (``qkwatch.contract.metrics``): ``qkwatch/<metric>/layer_<i>``
for a per-layer value (:func:`layer_tag`), ``qkwatch/<scalar>`` for a run-level one. Steps are the
optimizer's: the report's own ``step``.

Pure: no threads, no I/O (the sinks themselves live in their own modules).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

PREFIX = "qkwatch"
"""The first part of every name a sink writes."""


def layer_tag(metric: str, layer: int, n_layers: int) -> str:
    """``qkwatch/qkai/layer_07``: the name of one layer's value; the layer zero-padded to the width of
    the largest layer number (at least two digits), so the names sort in layer order."""
    width = max(2, len(str(max(0, n_layers - 1))))
    return f"{PREFIX}/{metric}/layer_{layer:0{width}d}"


def scalar_tag(name: str) -> str:
    """``qkwatch/<name>``: the name of a run-level value (``qkwatch/loss``)."""
    return f"{PREFIX}/{name}"


@dataclass(frozen=True)
class RunInfo:
    """The run the sinks are opened for."""

    project: str
    run: str
    n_layers: int
    rank: int = 0
    world: int = 1
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The name a tracker run of this rank takes: the run's, ``-rank<r>`` added on ranks other than 0."""
        return self.run if self.world == 1 or self.rank == 0 else f"{self.run}-rank{self.rank}"


@dataclass(frozen=True)
class SinkReport:
    """One report as the sinks receive it: finite numbers only (a value not measured, or not finite, is left out)."""

    step: int
    time: float
    layers: dict[str, dict[int, float]]
    """metric -> layer -> value (only the layers this rank measured)."""
    scalars: dict[str, float]
    """run-level values (loss, lr, the agent's health) by name."""

    @classmethod
    def from_wire(cls, report: Mapping[str, Any]) -> SinkReport:
        """From an encoded report (``qkwatch.contract.wire.Report``'s fields; "nan", "inf" and None left out)."""
        layers: dict[str, dict[int, float]] = {}
        for metric, values in (report.get("layers") or {}).items():
            per_layer = {i: float(v) for i, v in enumerate(values) if _finite(v)}
            if per_layer:
                layers[metric] = per_layer
        scalars = {name: float(v) for name, v in (report.get("scalars") or {}).items() if _finite(v)}
        return cls(step=int(report["step"]), time=float(report["time"]), layers=layers, scalars=scalars)

    def flat(self, n_layers: int) -> dict[str, float]:
        """Every value by its sink name (:func:`layer_tag`, :func:`scalar_tag`)."""
        out = {layer_tag(m, i, n_layers): v for m, per_layer in self.layers.items() for i, v in per_layer.items()}
        out.update({scalar_tag(name): v for name, v in self.scalars.items()})
        return out


@dataclass(frozen=True)
class SinkAlert:
    """An alert as the sinks receive it: it began firing (``firing``) or ended at ``step``."""

    rule: str
    """The rule's name (``qkai_band``)."""
    firing: bool
    step: int
    title: str
    """One line: what fired, on which layers."""
    text: str
    """A few lines: the values and the threshold they crossed."""
    severity: str = "warning"
    """The rule's severity (``warning``, ``critical``)."""
    metric: str = ""
    """The metric the rule reads (``qkai``)."""
    layers: tuple[int, ...] = ()
    """The layers it fires on (a band: every layer of the band)."""
    onset_step: int | None = None
    """Where the streak that made it fire began (the collector's alert's ``onset_step``)."""


@runtime_checkable
class Sink(Protocol):
    """Where reports go. Every method is called on the sinks' worker thread, never the training thread."""

    name: str
    """Named in the one warning a failing sink gets (``tensorboard``, ``wandb``, ``mlflow``)."""

    def open(self, run: RunInfo) -> None:
        """Called once, before the first report."""

    def write(self, report: SinkReport) -> None:
        """One report's values, at ``report.step``."""

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        """The layer x step picture of ``metric`` so far (``layers[i][j]``: layer i at ``steps[j]``), at ``step``."""

    def alert(self, alert: SinkAlert) -> None:
        """An alert began or ended (W&B: ``run.alert``; otherwise a tag or an event)."""

    def close(self) -> None:
        """The run ended: flush and let go of what the sink opened (not what it was given)."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
