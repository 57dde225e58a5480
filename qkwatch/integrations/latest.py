"""The reports a trainer's own loggers get: a sink that holds them until the training thread takes them.

Both integrations put qkwatch's per-layer values in the loggers the user already set up (the HF
Trainer's ``report_to``, Lightning's ``trainer.loggers``). Those loggers belong to the training
thread, and the agent hands its reports to the sinks on the sinks' worker thread
(``qkwatch.agent.sinks``), so the two meet here: the integration gives the agent one
:class:`LatestReports` among its ``sinks``; the worker writes each report in, under a lock, into a
bounded buffer; the training thread, in one of the trainer's own hooks, takes what has arrived
(:meth:`LatestReports.drain`) and logs it there. Nothing waits: a drain that finds nothing returns
nothing, and a report the training thread has not taken when ``keep`` newer ones arrived is pushed
out (counted in :attr:`LatestReports.dropped`; the collector and the spool keep every report).

Which values: the per-layer metrics chosen with :func:`chosen_metrics` (by default the catalogue's
primary ones, ``qkwatch.contract.metrics.layer_metrics()`` with ``primary``), named as every sink
names them: ``qkwatch/<metric>/layer_07`` (``layer_tag``). Run-level scalars are left out: they are
the trainer's own (its loss and learning rate), already in its loggers.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from qkwatch.agent import RunInfo, SinkAlert, SinkReport, layer_tag
from qkwatch.contract.metrics import layer_metrics, primary_layer_metrics

KEEP = 256
"""Reports the buffer holds for the training thread; older ones are pushed out (and counted)."""


def chosen_metrics(choice: bool | Iterable[str]) -> tuple[str, ...]:
    """The per-layer metrics an integration puts in its trainer's logs.

    Args:
        choice: True: the catalogue's primary per-layer metrics (QKAI, stable rank, attention
            entropy, logit max, lambda); False: none (switched off); names: those metrics.

    Raises:
        ValueError: a name that is not a per-layer metric of the catalogue (named).
    """
    if choice is True:
        return primary_layer_metrics()
    if choice is False:
        return ()
    if isinstance(choice, str):
        choice = [choice]
    names = tuple(dict.fromkeys(choice))
    known = {m.name for m in layer_metrics()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"tracker_logs: {unknown} are not per-layer metrics (known: {', '.join(sorted(known))})")
    return names


class LatestReports:
    """A sink (``qkwatch.agent.sinks.base.Sink``) whose reports the training thread takes; see the module."""

    name = "trainer-logs"
    """The name the agent's one warning gives this sink if it ever fails."""

    def __init__(self, metrics: Sequence[str], keep: int = KEEP) -> None:
        """
        Args:
            metrics: the per-layer metrics to keep (:func:`chosen_metrics`).
            keep: most reports held for the training thread.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.metrics = tuple(metrics)
        self.dropped = 0
        """Reports pushed out before the training thread took them."""
        self._lock = threading.Lock()  # the worker thread writes, the training thread drains
        self._reports: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=keep)
        self._n_layers = 0

    # --- the sinks' worker thread ---------------------------------------------------------------------

    def open(self, run: RunInfo) -> None:
        with self._lock:
            self._n_layers = run.n_layers

    def write(self, report: SinkReport) -> None:
        """Keep the report's values of the chosen metrics (a report with none of them is not kept)."""
        with self._lock:
            values = named_values(report.layers, self.metrics, self._n_layers)
            if not values:
                return
            if len(self._reports) == self._reports.maxlen:
                self.dropped += 1
            self._reports.append((report.step, values))

    def heatmap(self, metric: str, steps: list[int], layers: list[list[float | None]], step: int) -> None:
        """Nothing: a trainer's logs take scalars."""

    def alert(self, alert: SinkAlert) -> None:
        """Nothing: alerts reach the collector and the trackers' own sinks."""

    def close(self) -> None:
        """Nothing to let go of; what is held stays for a last :meth:`drain`."""

    # --- the training thread ----------------------------------------------------------------------------

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Every report held, oldest first, as ``(its step, {name: value})``; the buffer is left empty."""
        with self._lock:
            taken = list(self._reports)
            self._reports.clear()
        return taken


def named_values(layers: Mapping[str, Mapping[int, float]], metrics: Sequence[str], n_layers: int) -> dict[str, float]:
    """``{"qkwatch/qkai/layer_00": value, ...}``: the values of ``metrics`` in ``layers`` (metric -> layer -> value)."""
    return {
        layer_tag(metric, layer, n_layers): value
        for metric in metrics
        for layer, value in sorted(layers.get(metric, {}).items())
    }


def with_sink(settings: Mapping[str, Any], sink: LatestReports | None) -> dict[str, Any]:
    """``settings`` for :func:`qkwatch.attach` with ``sink`` added to the sinks the user gave.

    The user's sinks are the ``sinks`` setting, else ``QKWATCH_SINKS`` (read here because an explicit
    ``sinks`` argument would otherwise hide the environment's): a list, one sink, or one string of
    comma-separated names.
    """
    out = dict(settings)
    if sink is None:
        return out
    given = out.get("sinks")
    if given is None:
        given = os.environ.get("QKWATCH_SINKS") or ()
    if isinstance(given, str):
        given = [name.strip() for name in given.split(",") if name.strip()]
    elif not isinstance(given, Iterable):
        given = [given]
    out["sinks"] = [*given, sink]
    return out
