"""Delivery of the agent's reports: a packed report to the host, into the spool, and the sender woken.

On the CPU a report is encoded and written to the spool on the training thread (a few
microseconds, one ``write``); on a GPU the host-copy thread (``agent.host_copy``) waits for the
device-to-host copy and writes it, so the step never waits for the device, and a report that finds
its queue full is counted with the spool's drops. Each write feeds the local schedule its
entropies and wakes the sender (``agent.shipping.shipper``). How the run ended is spooled last, as the record
after the last report, in order through the same host-copy thread. Once spooled, each report is
offered to the sinks' worker (``agent.sinks.worker``: a put into its bounded queue, never a wait),
and nothing changes it after that.

:class:`ReportDelivery` is the part of :class:`qkwatch.agent.agent.Agent` that does this; the
agent's constructor sets the parts it uses.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from qkwatch.agent.health import DropNotes, Health
from qkwatch.agent.host_copy import HostCopyWriter, start_host_copy
from qkwatch.agent.identity import RunIdentity
from qkwatch.agent.lambdas.lambdas import Lambdas
from qkwatch.agent.report import Packed, encode, encode_logged
from qkwatch.agent.shipping.disk_spool import Spool, encode_record
from qkwatch.agent.shipping.shipper import Sender
from qkwatch.agent.sinks.worker import SinkWorker
from qkwatch.contract.wire import STATUS_REASON_MAX

logger = logging.getLogger(__name__)


class ReportDelivery:
    """Spools packed reports and the run's end status, and wakes the sender (a base of ``Agent``)."""

    # set by Agent.__init__
    identity: RunIdentity
    n_layers: int
    rank: int
    owned: set[int]
    spool: Spool
    sender: Sender
    sinks: SinkWorker | None
    health: Health
    lambdas_state: Lambdas
    _drops: DropNotes
    _host_copy: HostCopyWriter | None

    @property
    def attempt_key(self) -> str:
        key = self.identity.attempt_key
        assert key is not None, "RunIdentity.agree() always makes one"
        return key

    def _ship(self, packed: Packed) -> None:
        """Start the pack's copy to the host; spool it now (CPU) or once the copy is done (GPU)."""
        packed.values, packed.ready = start_host_copy(packed.values)
        if packed.ready is None:
            self._write_report(packed)
            return
        if self._host_copy is None:
            self._host_copy = HostCopyWriter(self._write_report, self._append_status)
        if not self._host_copy.put(packed):
            # the step never waits: counted like the spool caps' drops, a report per step it held
            self.spool.count_dropped(len(packed.logged_times) + int(packed.main))

    def _write_report(self, packed: Packed) -> None:
        """Host side: encode the report, spool it, feed the local schedule (the training or host-copy thread).

        Room is made in the spool before the report's own count of dropped reports is set, so the
        count it carries includes every drop made to fit it.
        """
        report = encode(packed, self.n_layers) if packed.main else None
        logged = encode_logged(packed)
        try:
            self._spool_reports(logged, report)
        finally:  # a spool that refused them still leaves the sinks theirs
            self._offer_sinks(logged, report)
        if report is None:
            return
        entropy = report["layers"].get("attn_entropy")
        if entropy:
            self.lambdas_state.observe(
                {i: float(v) for i, v in enumerate(entropy) if isinstance(v, float) and i in self.owned}
            )

    def _offer_sinks(self, logged: list[dict[str, Any]], report: dict[str, Any] | None) -> None:
        """Hand the reports, in step order, to the sinks' worker (a queue put each, never a wait)."""
        if self.sinks is not None:
            for r in [*logged, *([report] if report is not None else [])]:
                self.sinks.offer(r)

    def _spool_reports(self, logged: list[dict[str, Any]], report: dict[str, Any] | None) -> None:
        """The scalar-only reports of earlier steps, then the report (if any), in one write.

        Room is made once for all of them; the report's drop count is set after it, so it includes
        every drop made to fit them (the report's size is counted before the count is added: the
        256 bytes a record are the margin).
        """
        records = [encode_record({"attempt_key": self.attempt_key, "report": r}) for r in logged]
        incoming = sum(len(r) + 256 for r in records)
        if report is not None:
            incoming += len(json.dumps(report)) + 256
        if not records and report is None:
            return
        self.spool.make_room(incoming)
        if report is not None:
            self._drops.note(report, self.spool.dropped)
            records.append(encode_record({"attempt_key": self.attempt_key, "report": report}))
        self.spool.append_encoded(records)
        self.health.written += len(records)
        self.sender.notify()

    def _spool_status(self, status: str | None, reason: str | None, deadline: float) -> None:
        """Spool how the run ended as the record after the last report (in order through the GPU host-copy thread)."""
        if status is None or (status == "finished" and self.rank != 0):
            return
        end: dict[str, Any] = {"status": status}
        if reason and reason.strip():
            end["reason"] = _bounded(reason.strip())
        record = {"attempt_key": self.attempt_key, "status": end}
        if self._host_copy is not None:
            self._host_copy.put_status(record, deadline - time.monotonic())
        else:
            self._append_status(record)

    def _append_status(self, record: dict[str, Any]) -> None:
        try:
            self.spool.append(record)
        except (OSError, ValueError) as exc:
            logger.warning("qkwatch: could not spool the run's status %s: %s", record["status"], exc)
            return
        self.sender.notify()


def _bounded(reason: str) -> str:
    return reason if len(reason) <= STATUS_REASON_MAX else reason[: STATUS_REASON_MAX - 3] + "..."
