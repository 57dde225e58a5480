"""Background delivery of the spool to the collector; the training step never waits for it.

The sender thread creates (or resumes) the run once the collector answers, then posts the
spool's records in batches, oldest first, and acknowledges them in the spool only after the
collector has stored them. Delivery is at-least-once; the collector's idempotency (the batch id,
derived from the records' place in the spool, and the natural key of every point) makes it
exactly-once. Failures:

* connection errors, timeouts, 3xx (never followed), 408, 429, 5xx, and answers that are too
  slow, too long or not what the contract says: retried with exponential backoff and full jitter
  (``uniform(0, min(cap, base * 2^n))``), never sooner than a ``Retry-After`` asks;
* 413 (batch too large): the batch is halved; a single report that is still too large, and any
  other 4xx, goes to ``dead-letter.jsonl`` with the collector's answer, with one warning.

Nothing a collector answers stops the thread: an unexpected exception is warned about once (per
kind), counted as a failure and retried like one.

Records carry the attempt key of the process that wrote them, so a spool holding reports of an
earlier (crashed) attempt delivers them to that attempt.

A record is a report (``{"attempt_key", "report"}``) or, last, how the attempt ended
(``{"attempt_key", "status": {"status", "reason"}}``, written by ``Agent.close``). A status is
sent alone, as ``PATCH /v1/runs/{id}`` with its attempt, once every report before it is stored;
the PATCH is idempotent, so a replay is harmless.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from qkwatch.agent.checks import positive_ints, positive_seconds
from qkwatch.agent.health import Health
from qkwatch.agent.identity import RunIdentity
from qkwatch.agent.shipping.disk_spool import Position, Record, Spool, encode_record
from qkwatch.agent.shipping.transport import Transport, TransportError
from qkwatch.contract import api
from qkwatch.contract.answers import RunAnswer

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER = 600.0
"""A Retry-After longer than this is read as this (a misconfigured server must not stall delivery for days)."""
NAMESPACE = uuid.UUID("6f1c2f0e-9c3e-4d0a-8a57-2f3c1e7b9a10")


@dataclass
class SenderConfig:
    """How the sender batches and retries."""

    batch_max_reports: int = 64
    """Reports per POST at most."""
    flush_seconds: float = 0.5
    """The sender wakes at least this often when reports wait."""
    backoff_base: float = 0.5
    """First retry delay ceiling in seconds (full jitter, doubling)."""
    backoff_cap: float = 30.0
    """Largest retry delay in seconds."""

    def __post_init__(self) -> None:
        positive_ints(self, "batch_max_reports")
        positive_seconds(self, "flush_seconds", "backoff_base", "backoff_cap")

    def build(
        self, spool: Spool, transports: Callable[[], Transport], *, health: Health, name: str = "qkwatch-sender"
    ) -> Sender:
        """A sender (not started) delivering ``spool`` over transports from ``transports``."""
        return Sender(
            spool,
            transports,
            batch_max=self.batch_max_reports,
            flush_seconds=self.flush_seconds,
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            health=health,
            name=name,
        )


class Sender:
    """Delivers one spool from a named daemon thread (or synchronously: :meth:`deliver_all`)."""

    def __init__(
        self,
        spool: Spool,
        transport_factory: Callable[[], Transport],
        *,
        batch_max: int,
        flush_seconds: float,
        backoff_base: float,
        backoff_cap: float,
        health: Health,
        on_run: Callable[[str, int], None] | None = None,
        name: str = "qkwatch-sender",
    ):
        self.spool = spool
        self.transport_factory = transport_factory
        self.batch_max = batch_max
        self.flush_seconds = flush_seconds
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.health = health
        self.on_run = on_run
        self.run_id: str | None = spool.read_meta().get("run_id")
        self._attempts: dict[str, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._drain_until: float | None = None
        self._failures = 0
        self._batch = batch_max
        self._warned_dead = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._transport: Transport | None = None
        self._retry_after: float | None = None
        self._unexpected: set[str] = set()  # kinds of exception already warned about

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    def close(self, timeout: float) -> bool:
        """Try to deliver what is spooled until ``timeout``; True if the thread finished."""
        self._drain_until = time.monotonic() + max(0.0, timeout)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, timeout - 0.05))
        self._stop.set()  # interrupts a backoff sleep; an HTTP call in flight ends by its own timeout
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(0.05)
        return not self._thread.is_alive()

    def deliver_all(self, deadline: float | None = None) -> bool:
        """Synchronously deliver everything (``qkwatch sync``); True when nothing is left."""
        while deadline is None or time.monotonic() < deadline:
            sent = self._send_guarded()
            if sent is None:
                return True
            if sent is False:
                self._sleep_backoff(deadline)
        return not self.spool.pending(1)

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            result = self._send_guarded()
            drain_until = self._drain_until  # set once, by close()
            if result is None:  # nothing pending
                if drain_until is not None:
                    return
                self._wake.wait(self.flush_seconds)
                self._wake.clear()
            elif result is False:
                if drain_until is not None and time.monotonic() >= drain_until:
                    return
                self._sleep_backoff(self._drain_until)
            elif drain_until is not None and time.monotonic() >= drain_until:
                return

    def _send_guarded(self) -> bool | None:
        """:meth:`_send_some`, with anything unexpected turned into a retryable failure: the thread carries on."""
        try:
            return self._send_some()
        except Exception as exc:  # the sender must outlive whatever an answer (or a bug) does
            with contextlib.suppress(Exception):
                self.spool.release()
            self._failures += 1
            self.health.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            kind = type(exc).__name__
            if kind not in self._unexpected:
                self._unexpected.add(kind)
                logger.warning("qkwatch: delivery failed unexpectedly (%s: %s); retrying", kind, str(exc)[:200])
            return False

    def _send_some(self) -> bool | None:
        """Send one batch of reports, or one status: True sent (or dead-lettered), False failed
        retryably, None nothing to do."""
        records = self.spool.pending(self._batch)
        if not records:
            return None
        head = records[0]
        key = head.payload.get("attempt_key", "")
        batch = [head] if "status" in head.payload else list(_reports(records, key))
        if not batch:
            return self._unknown(head)
        try:
            attempt = self._attempt(key, head.payload)
            self._post(batch, attempt)
        except TransportError as exc:
            self.spool.release()
            return self._failed(exc, batch)
        self._delivered(batch)
        return True

    def _post(self, records: list[Record], attempt: int) -> None:
        run_id = self.run_id
        assert run_id is not None, "_attempt() has created or resumed the run"
        status = records[0].payload.get("status")
        if status is not None:
            self._client().set_status(run_id, {**status, "attempt": attempt})
            logger.info("run %s (attempt %d) marked %s", run_id, attempt, status.get("status"))
            return
        body = {
            "batch_id": str(_batch_id(self.spool, records)),
            "attempt": attempt,
            "reports": [r.payload["report"] for r in records],
        }
        self._client().post_reports(run_id, body)

    def _attempt(self, key: str, payload: dict[str, Any]) -> int:
        if key not in self._attempts:
            meta = self.spool.read_meta()
            answer = _run_answer(self._client().create_run(RunIdentity.of_spool(meta, key).create_body()))
            self.run_id, self._attempts[key] = answer.id, answer.attempt
            if meta.get("run_id") != self.run_id:
                self.spool.write_meta({**meta, "run_id": self.run_id})
            if self.on_run is not None and key == meta.get("attempt_key"):
                self.on_run(self.run_id, self._attempts[key])
        return self._attempts[key]

    def _delivered(self, records: list[Record]) -> None:
        self.spool.ack(_after(records))
        self.health.sent += _count_reports(records)
        self.health.acked += _count_reports(records)
        self._failures = 0
        self._batch = self.batch_max

    def _failed(self, exc: TransportError, records: list[Record]) -> bool:
        self.health.last_error = str(exc)[:300]
        if exc.status == 413 and len(records) > 1:
            self._batch = max(1, len(records) // 2)
            return True  # resend at once, smaller
        if exc.retryable:
            self.health.retried += 1
            self._failures += 1
            self._retry_after = exc.retry_after
            logger.debug("delivery failed, will retry: %s", exc)
            return False
        self.spool.dead_letter(
            {
                "status": exc.status,
                "response": exc.body[:10000],
                "reports": [r.payload for r in records],
                "time": time.time(),
            }
        )
        self.health.dead_lettered += len(records)
        self.spool.ack(_after(records))
        self.health.acked += _count_reports(records)
        if not self._warned_dead:
            self._warned_dead = True
            logger.warning(
                "the collector refused %d report(s) for good (HTTP %s): %s; they are in %s "
                "(further refusals are counted, not logged)",
                len(records),
                exc.status,
                exc.body[:300],
                self.spool.path / "dead-letter.jsonl",
            )
        return True

    def _unknown(self, record: Record) -> bool:
        """A record neither a report nor a status (a newer agent's spool?): set aside, not sent."""
        self.spool.dead_letter(
            {
                "status": None,
                "response": "not a report or a status record",
                "reports": [record.payload],
                "time": time.time(),
            }
        )
        self.spool.ack(record.end)
        logger.warning(
            "spool %s: a record of unknown kind (keys %s) moved to dead-letter.jsonl",
            self.spool.path,
            sorted(record.payload),
        )
        return True

    def _sleep_backoff(self, deadline: float | None) -> None:
        delay = random.uniform(0, min(self.backoff_cap, self.backoff_base * 2 ** min(self._failures, 30)))
        if self._retry_after is not None:
            delay = max(delay, min(self._retry_after, MAX_RETRY_AFTER))
            self._retry_after = None
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        self._stop.wait(delay)

    def _client(self) -> Transport:
        if self._transport is None:
            self._transport = self.transport_factory()
        return self._transport


def requeue_dead_letters(spool: Spool) -> int:
    """Put the records of ``spool``'s ``dead-letter.jsonl`` back in the spool to be sent again; how many.

    For after the cause is fixed (a collector that refused them for good, a redirect that older
    agents read as a refusal). The records are appended first and the file is then renamed
    ``dead-letter.resent-<unix time>.jsonl`` (kept): a crash in between re-sends them twice at worst,
    which the collector stores once. A line that is not a dead letter is left out, with a warning.
    """
    path = spool.path / "dead-letter.jsonl"
    if not path.is_file():
        return 0
    records: list[dict[str, Any]] = []
    skipped = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            payloads = entry["reports"]
            if not isinstance(payloads, list) or not all(isinstance(p, dict) for p in payloads):
                raise TypeError("reports is not a list of records")
        except (ValueError, KeyError, TypeError, RecursionError):
            skipped += line.strip() != ""
            continue
        records += [p for p in payloads if "report" in p or "status" in p]
    if records:
        spool.append_encoded([encode_record(r) for r in records])
    path.rename(spool.path / f"dead-letter.resent-{int(time.time())}.jsonl")
    if skipped:
        logger.warning(
            "qkwatch: %s: %d line(s) of dead-letter.jsonl are not dead letters; left out", spool.path, skipped
        )
    return len(records)


def _run_answer(answer: object) -> RunAnswer:
    """The collector's run, or a retryable failure for an answer that is not one (``{}``, ``{"id": null}``)."""
    try:
        return RunAnswer.model_validate(answer)
    except ValidationError:
        raise TransportError(f"POST {api.RUNS}: the answer is not a run", retryable=True) from None


def _reports(records: list[Record], key: str) -> Iterator[Record]:
    """The leading reports of one attempt key; a status record ends the batch (it is sent after them)."""
    for record in records:
        if record.payload.get("attempt_key", "") != key or "report" not in record.payload:
            return
        yield record


def _count_reports(records: list[Record]) -> int:
    return sum("report" in r.payload for r in records)


def _after(records: list[Record]) -> Position:
    return records[-1].end


def _batch_id(spool: Spool, records: list[Record]) -> uuid.UUID:
    """The same records always form the same batch id, whichever process sends them."""
    spool_id = spool.read_meta().get("spool_id", str(spool.path))
    first, last = records[0], records[-1]
    return uuid.uuid5(
        NAMESPACE, f"{spool_id}:{first.start.segment}:{first.start.offset}:{last.end.segment}:{last.end.offset}"
    )
