"""GPU only: the thread that waits for each report's host copy, so the training step never does.

The training thread starts the report's one device-to-host copy (:func:`start_host_copy`) and
hands the report to the :class:`HostCopyWriter`; its thread waits for the copy's CUDA event and
calls the writer it was given (the agent's, which appends the report to the disk spool). The
queue is bounded (:data:`QUEUE_REPORTS`) and a report that finds it full is not queued:
:meth:`HostCopyWriter.put` says so, and the caller counts it with the reports the spool's caps
drop, as the training step must never wait. The copies land a few steps behind the step at most
(the GPU runs that far behind the host), so the queue holds one or two reports; it fills only if
the writer itself stalls (a hung disk). The run's status record, put at close, waits for room.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from qkwatch.agent.report import Packed

logger = logging.getLogger(__name__)

QUEUE_REPORTS = 64
"""Reports waiting for their copy at most; far more than the steps a GPU runs behind its host."""


def start_host_copy(values: Tensor) -> tuple[Tensor, Any]:
    """Start the copy of a CUDA tensor to the host: the host tensor and the event marking the copy
    done; a tensor already on the host comes back as it is, with None."""
    if values.device.type != "cuda":
        return values, None
    host = values.to("cpu", non_blocking=True)  # the report's one device-to-host copy
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    ready.record()
    return host, ready


class HostCopyWriter:
    """A named daemon thread writing reports once their copy lands, in the order they were put."""

    def __init__(
        self,
        write_report: Callable[[Packed], None],
        write_status: Callable[[dict[str, Any]], None],
        *,
        maxsize: int = QUEUE_REPORTS,
    ):
        self.write_report = write_report
        self.write_status = write_status
        self.queue: queue.Queue[Packed | dict[str, Any] | None] = queue.Queue(maxsize)
        self._warned = False
        self.thread = threading.Thread(target=self._run, name="qkwatch-host-copy", daemon=True)
        self.thread.start()

    def put(self, report: Packed) -> bool:
        """Queue a report whose copy is on its way; False, at once, when the queue is full."""
        try:
            self.queue.put_nowait(report)
        except queue.Full:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "qkwatch: the host-copy queue is full (%d reports): dropping the report of step %d "
                    "(counted in agent_dropped_total; further drops are counted, not logged)",
                    self.queue.maxsize,
                    report.step,
                )
            return False
        return True

    def put_status(self, record: dict[str, Any], timeout: float) -> bool:
        """Queue the run's status record behind the reports before it, waiting up to ``timeout`` for room."""
        try:
            self.queue.put(record, timeout=max(0.0, timeout))
        except queue.Full:
            logger.warning(
                "qkwatch: could not spool the run's status %s: the host-copy writer is stuck", record["status"]
            )
            return False
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued within ``timeout``; the thread is a daemon, so a stuck copy ends with the process."""
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            self.queue.put(None, timeout=max(0.0, timeout))
        except queue.Full:
            return
        self.thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if isinstance(item, dict):
                self.write_status(item)
                continue
            try:
                item.ready.synchronize()
                self.write_report(item)
            except Exception:
                logger.exception("qkwatch: could not spool the report of step %d", item.step)
