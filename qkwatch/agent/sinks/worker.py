"""The sinks' worker: one daemon thread between the agent's reports and every sink.

The agent hands each encoded report to :meth:`SinkWorker.offer` where it has spooled it (on the
training thread on the CPU, on the host-copy thread on a GPU): a put into a bounded queue, which
never waits. A full queue drops the report for the sinks (the spool still has it), counts it
(:attr:`SinkWorker.dropped`) and warns once. The worker thread then, per report, in order:

* opens every sink the first time (``Sink.open``, once, on this thread);
* writes the report's values (``Sink.write``, a :class:`SinkReport` at the report's own step);
* judges it with the alert rules (``sinks.alerts``) and sends each alert that begins firing or
  resolves (``Sink.alert``);
* every ``heatmap_every`` reports with per-layer values (0: never), draws the history of each
  primary per-layer metric (``sinks.history``) as ``Sink.heatmap``; once more at close when a
  report came since the last one.

A sink that raises is logged once (a warning naming the sink, the call and the error) and called
again with the next report: it never stops training, the other sinks or the worker. ``close``
drains what is queued, closes every sink (on this thread), and returns within its timeout even when
a sink never returns (the daemon thread is then left behind, and the process exits without it).

The report dicts it is given are read, never changed, and must not be changed by the caller after
the offer (the agent offers a report once the spool has it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from qkwatch.agent.sinks.alerts import LocalAlerts
from qkwatch.agent.sinks.base import RunInfo, Sink, SinkReport
from qkwatch.agent.sinks.history import HEATMAP_COLUMNS, LayerHistory
from qkwatch.contract.metrics import primary_layer_metrics

logger = logging.getLogger(__name__)

_END = object()
"""The queue's last item: every report before it is written, then the sinks are closed."""


class SinkWorker:
    """Owns the sinks of one rank; see the module's docstring."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        run: RunInfo,
        *,
        alerts: LocalAlerts | None = None,
        heatmap_every: int = 10,
        queue_size: int = 256,
        heatmap_columns: int = HEATMAP_COLUMNS,
    ):
        """
        Args:
            sinks: where the reports go (opened on the worker thread with ``run``).
            run: the run and this rank (``rank``, ``world``: each rank's worker sees its own layers).
            alerts: the rules to judge each report with (None: no alerts).
            heatmap_every: draw the heatmaps every this many reports with per-layer values (0: never).
            queue_size: reports that may wait for the worker; more are dropped and counted.
            heatmap_columns: most report steps one heatmap draws.
        """
        if heatmap_every < 0 or queue_size < 1:
            raise ValueError(f"heatmap_every must be >= 0 and queue_size >= 1, got {heatmap_every}, {queue_size}")
        self.sinks = list(sinks)
        self.run = run
        self.heatmap_every = heatmap_every
        self.queue_size = queue_size
        self.dropped = 0
        """Reports the sinks never saw: the queue was full when they were offered."""
        self.written = 0
        """Reports the worker has taken through every sink."""
        self.failures: dict[str, int] = {}
        """Calls that raised, by sink name."""
        self._alerts = alerts
        self._columns = heatmap_columns
        self._histories: dict[str, LayerHistory] = {}
        self._primary = primary_layer_metrics()
        self._since_heatmap = 0
        self._last_step: int | None = None
        self._opened = False
        self._warned: set[int] = set()  # id() of each sink warned about
        self._queue: collections.deque[Any] = collections.deque()
        self._ready = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"qkwatch-sinks-{run.rank}", daemon=True)
        self._thread.start()

    # --- the agent's side (any thread; never waits) ------------------------------------------------

    def offer(self, report: Mapping[str, Any]) -> bool:
        """Queue an encoded report (the wire's fields) for the sinks; False when it was dropped."""
        with self._ready:
            if self._closing:
                return False
            if len(self._queue) >= self.queue_size:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "qkwatch: the sinks fall behind (%d reports wait); reports are dropped for the sinks "
                        "(counted, and still spooled) until they catch up",
                        self.queue_size,
                    )
                return False
            self._queue.append(report)
            self._ready.notify()
            return True

    def stop(self) -> None:
        """No more reports: the worker writes what is queued, closes the sinks and ends (returns at once)."""
        with self._ready:
            if not self._closing:
                self._closing = True
                self._queue.append(_END)
                self._ready.notify()

    def close(self, timeout: float = 10.0) -> bool:
        """:meth:`stop`, then wait at most ``timeout`` seconds for the worker; True when it ended. Idempotent."""
        self.stop()
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            with self._ready:
                left = sum(1 for item in self._queue if item is not _END)
            logger.warning(
                "qkwatch: the sinks had not finished when close()'s timeout ran out (%d reports not written); "
                "they are left behind (the spool keeps every report)",
                left,
            )
            return False
        return True

    @property
    def pending(self) -> int:
        """Reports waiting for the worker."""
        with self._ready:
            return sum(1 for item in self._queue if item is not _END)

    # --- the worker thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                item = self._queue.popleft()
            if item is _END:
                self._finish()
                return
            try:
                self._handle(item)
            except Exception:  # a bug of ours must not end the thread and leave the queue to fill
                logger.exception("qkwatch: the sinks' worker could not handle a report")
            self.written += 1

    def _handle(self, wire: Mapping[str, Any]) -> None:
        if not self._opened:
            self._opened = True
            self._each("open", self.run)
        report = SinkReport.from_wire(wire)
        self._each("write", report)
        if not report.layers:
            return
        if self._alerts is not None:
            for alert in self._alerts.judge(wire):
                self._each("alert", alert)
        self._remember(report)
        if self.heatmap_every and self._since_heatmap >= self.heatmap_every:
            self._heatmaps()

    def _remember(self, report: SinkReport) -> None:
        for metric in self._primary:
            values = report.layers.get(metric)
            if values:
                history = self._histories.get(metric)
                if history is None:
                    history = self._histories[metric] = LayerHistory(self.run.n_layers, self._columns)
                history.add(report.step, values)
        self._since_heatmap += 1
        self._last_step = report.step

    def _heatmaps(self) -> None:
        self._since_heatmap = 0
        step = self._last_step if self._last_step is not None else 0
        for metric, history in self._histories.items():
            steps, layers = history.grid()
            self._each("heatmap", metric, steps, layers, step)

    def _finish(self) -> None:
        """The last heatmap (when a report came since the one before), then every sink closed."""
        if self._opened:
            if self.heatmap_every and self._since_heatmap:
                self._heatmaps()
            self._each("close")

    def _each(self, call: str, *args: Any) -> None:
        """``sink.<call>(*args)`` on every sink; a sink that raises is warned about once and called again next time."""
        for sink in self.sinks:
            _yield_the_gil()
            try:
                getattr(sink, call)(*args)
            except Exception as exc:
                name = getattr(sink, "name", type(sink).__name__)
                self.failures[name] = self.failures.get(name, 0) + 1
                if id(sink) not in self._warned:
                    self._warned.add(id(sink))
                    logger.warning(
                        "qkwatch: sink %r failed in %s(): %s: %s; it still gets the next reports, and this "
                        "is the only warning about it",
                        name,
                        call,
                        type(exc).__name__,
                        exc,
                    )


def _yield_the_gil() -> None:
    """Let a thread waiting for the GIL (the training thread, back from a torch op) take it now, not
    after the interpreter's switch interval (5 ms by default) that a busy worker would hold it for:
    the worker's Python work comes in pieces between calls, each as short as one sink call."""
    time.sleep(0)
