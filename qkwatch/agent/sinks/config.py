"""The sinks' settings, a component of the agent's config (``AgentConfig.sinking``).

Every field is also a keyword of :func:`qkwatch.attach`; ``sinks`` may also come from the
environment (``QKWATCH_SINKS=tensorboard,wandb``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkwatch.agent.checks import SettingError, cadences, positive_ints
from qkwatch.agent.sinks import NAMES, resolve
from qkwatch.agent.sinks.alerts import LocalAlerts, load_rules
from qkwatch.agent.sinks.base import RunInfo, Sink
from qkwatch.agent.sinks.worker import SinkWorker


@dataclass
class SinkConfig:
    """Where reports go besides the collector, and how the sinks' worker paces them."""

    sinks: tuple[Sink | str, ...] = ()
    """Sinks (``QKWATCH_SINKS``): objects implementing ``qkwatch.agent.sinks.base.Sink``, or the names
    ``tensorboard``, ``wandb``, ``mlflow`` (each that sink with its defaults); a list, or one string of
    comma-separated names. Empty: the collector (and the spool) only."""
    heatmap_every: int = 10
    """Send each sink the layer x step heatmaps every this many reports with per-layer values, and
    once more at close (0 = never)."""
    sink_queue: int = 256
    """Reports that may wait for the sinks' worker; more are dropped for the sinks (and counted)."""
    sink_rules: str | Path | None = None
    """A rules file (the collector's format) for the alerts the sinks get; default: the collector's
    default rules (QKAI above the collapse threshold, ``QKWATCH_COLLAPSE_THRESHOLD``)."""

    def __post_init__(self) -> None:
        self.sinks = _sinks(self.sinks)
        cadences(self, "heatmap_every")
        positive_ints(self, "sink_queue")
        if self.sink_rules is not None and not isinstance(self.sink_rules, (str, Path)):
            raise SettingError("sink_rules", f"sink_rules must be a path, got {type(self.sink_rules).__name__}")

    def build(self, run: RunInfo) -> SinkWorker | None:
        """The worker (started) over the sinks, names resolved to sinks; None when there is none.

        Raises:
            ImportError: a named sink whose library is not installed (naming the extra).
            ValueError: a rules file the collector would refuse too.
        """
        if not self.sinks:
            return None
        sinks = [resolve(s) for s in self.sinks]
        try:
            rules = load_rules(self.sink_rules)
        except ValueError as exc:
            raise SettingError("sink_rules", f"sink_rules: {exc}") from None
        return SinkWorker(
            sinks, run, alerts=LocalAlerts(rules), heatmap_every=self.heatmap_every, queue_size=self.sink_queue
        )


def _sinks(value: Any) -> tuple[Sink | str, ...]:
    """The ``sinks`` setting as a tuple: names checked, objects checked against the protocol."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, Sink) or not isinstance(value, Iterable):
        value = [value]
    out: list[Sink | str] = []
    for item in value:
        if isinstance(item, str):
            if item.strip().lower() not in NAMES:
                raise SettingError("sinks", f"sinks: unknown sink {item!r} (known: {', '.join(NAMES)})")
            out.append(item.strip().lower())
        elif isinstance(item, Sink):
            out.append(item)
        else:
            raise SettingError(
                "sinks",
                f"sinks: {type(item).__name__} is not a sink (a name, or an object with name, open, write, "
                "heatmap, alert and close: qkwatch.agent.sinks.base.Sink)",
            )
    return tuple(out)
