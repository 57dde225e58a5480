"""A write-ahead spool on local disk: every report is on disk before anything tries to send it.

Layout of one spool directory (one run, one rank)::

    meta.json          the run it belongs to: collector URL, project, name, config, attempt key
    seg-00000001.log   records, appended; a new segment every ``segment_bytes``
    cursor.json        the first record not yet acknowledged by the collector
    dead-letter.jsonl  batches the collector refused for good, with its answer
    lock               held (flock) by the one process that owns the spool

A record is ``MAGIC | u32 length | u32 crc32(payload) | payload`` (little endian; the payload is
one report as JSON; the format is ``qkwatch.contract.spool_format``'s, which offline readers
share). A process killed mid-write leaves a torn tail: the reader stops at it and the next writer
truncates it, so only that record is lost; a corrupt record in the middle is
skipped by scanning for the next ``MAGIC``. Records are written with one ``write`` call and no
fsync: they survive the process being killed (``kill -9``), not a power cut.

Acknowledged segments are deleted. Beyond ``max_bytes`` of undelivered data, or for segments
older than ``max_age``, the oldest segments are dropped whole and their records counted in
``cursor.json``'s ``dropped``; that count travels to the collector with the next reports (so do
reports the agent's GPU host-copy writer could not take: :meth:`Spool.count_dropped`).

The disk may fill or turn read-only: no error of it leaves :meth:`Spool.append_encoded`. What it
refuses is held in memory, bounded, delivered from there and spooled once the disk takes writes
again (``agent.shipping.spool_memory``); a spool directory that cannot be used at all works from
memory alone. Damaged metadata is repaired with one warning (``agent.shipping.spool_files``); a
stray ``seg-backup.log`` is ignored. A forked child closes its copies of the spool's descriptors
(``agent.shipping.forks``), so the ``flock`` dies with its owner.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkwatch.agent.checks import positive_ints, positive_seconds
from qkwatch.agent.shipping.forks import ProcessLock
from qkwatch.agent.shipping.spool_files import SpoolFiles
from qkwatch.agent.shipping.spool_memory import MEMORY_SEGMENTS, HeldRecords, framed
from qkwatch.contract.spool_format import (
    MAX_RECORD,
    Position,
    Record,
    checked_cursor,
    scan,
    segment_files,
)

__all__ = ["Position", "Record", "Spool", "SpoolConfig", "SpoolLocked", "encode_record"]

logger = logging.getLogger(__name__)


@dataclass
class SpoolConfig:
    """How each rank's spool is cut into segments and capped."""

    segment_bytes: int = 4 * 2**20
    """Spool segment size before rotation."""
    spool_max_bytes: int = 256 * 2**20
    """Undelivered spool kept at most (bytes); beyond, the oldest segments are dropped and counted."""
    spool_max_age_seconds: float = 7 * 24 * 3600.0
    """Undelivered spool segments older than this are dropped and counted."""

    def __post_init__(self) -> None:
        positive_ints(self, "segment_bytes", "spool_max_bytes")
        positive_seconds(self, "spool_max_age_seconds")

    def open(self, path: str | Path) -> Spool:
        """The spool at ``path`` (created if new), owned by this process. Raises SpoolLocked."""
        return Spool(
            path, segment_bytes=self.segment_bytes, max_bytes=self.spool_max_bytes, max_age=self.spool_max_age_seconds
        )


class SpoolLocked(Exception):
    """Another process owns this spool (an agent still running, or a sync in progress)."""


class Spool(SpoolFiles):
    """One directory of records; safe for one writer thread and one reader thread of one process."""

    def __init__(
        self,
        path: str | Path,
        *,
        segment_bytes: int = SpoolConfig.segment_bytes,
        max_bytes: int = SpoolConfig.spool_max_bytes,
        max_age: float = SpoolConfig.spool_max_age_seconds,
        memory_max_bytes: int | None = None,
    ):
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.dropped = 0
        self._cursor = Position(0, 0)
        self._fd: int | None = None
        self._owner: ProcessLock | None = None
        self._lock = threading.Lock()  # the cursor and the memory: the writer's caps against the sender's acks
        self._in_flight: int | None = None
        self._segment = 0
        self._size = 0
        self._closed = False
        self._warned: set[str] = set()
        self._meta: dict[str, Any] | None = None  # the last meta written, kept for when the disk refuses it
        self._memory = HeldRecords(self.path, memory_max_bytes)
        self._disk_end_in_flight: Position | None = None  # the last disk record sent with them
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._owner = ProcessLock(self.path / "lock")
        except BlockingIOError:
            raise SpoolLocked(f"{self.path} is in use by another process (a running agent or qkwatch sync)") from None
        except OSError as exc:  # memory alone from here: without the lock, the disk is never tried again
            self._memory.refused(exc, "the spool directory cannot be used")
            return
        self._cursor, self.dropped = self._load_cursor()
        try:
            self._recover_tail()
        except OSError as exc:
            self._memory.refused(exc, "the spool's last segment cannot be repaired")
        self._cursor, problem = checked_cursor(self.path, self._cursor, self.segments())
        if problem:
            self._warn_once("cursor", "spool %s: cursor.json %s; reading from %s", self.path, problem, self._cursor)
        self._segment = max(self._segment, self._cursor.segment)  # no segment yet: begin where the cursor is

    # --- writing --------------------------------------------------------------------------

    def append(self, payload: dict[str, Any]) -> None:
        """Append one record (one ``write`` call); held in memory if the disk refuses it."""
        self.append_encoded([encode_record(payload)])

    def append_encoded(self, records: list[bytes]) -> None:
        """Append records made by :func:`encode_record`, in order, with one ``write`` call (a report and
        the scalar-only reports of the steps before it). An error of the disk never leaves here: the
        records are held in memory (see the module docstring). A write cut short by a kill leaves
        whole records and a torn tail, which the next open truncates."""
        for data in records:
            if len(data) > MAX_RECORD:
                raise ValueError(f"a report of {len(data)} bytes exceeds the spool's record limit of {MAX_RECORD}")
        if not records:
            return
        if self._memory or self._memory.error is not None:  # only this (the writer's) thread adds to memory
            with self._lock:
                self._write_or_hold(records)
            return
        try:
            self._write(b"".join(framed(data) for data in records))
        except OSError as exc:
            with self._lock:
                self._memory.refused(exc, "the disk refused a report")
                self.dropped += self._memory.hold(records)

    def _write(self, blob: bytes) -> None:
        """Append ``blob`` whole to the current segment, or raise OSError with nothing of it left there."""
        fd = self._fd
        if fd is None or self._size >= self.segment_bytes:
            fd = self._open_segment(self._segment + 1 if fd is not None else max(self._segment, 1))
        view, written = memoryview(blob), 0
        try:
            while written < len(blob):
                n = os.write(fd, view[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "the disk took none of a write")
                written += n  # a short write: the rest goes in the next call, or that one fails
        except OSError:
            if written:  # cut back (a truncate needs no space); if that fails, readers skip the torn bytes
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._size)
            raise
        self._size += len(blob)

    def _open_segment(self, number: int) -> int:
        """Close the current segment and open segment ``number`` for appending; returns its fd."""
        fd = os.open(self._segment_path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self._fd is not None:
            os.close(self._fd)
        self._segment, self._fd = number, fd
        self._size = os.fstat(fd).st_size
        return fd

    def _write_or_hold(self, records: list[bytes], *, now: bool = False) -> None:
        """While the disk refuses: write what memory holds and ``records`` if it takes them now, else hold them."""
        dropped = self._memory.write_or_hold(self._write if self._usable else None, records, now=now)
        self.dropped += dropped
        if self._memory.error is None:
            self._save_cursor()  # the drops made meanwhile

    def _recover_tail(self) -> None:
        """Truncate a torn record at the end of the newest segment (a writer killed mid-write)."""
        segments = self.segments()
        if not segments:
            return
        last = segments[-1]
        self._segment = last
        file = self._segment_path(last)
        good = 0
        for record in scan(file, 0, number=last):
            good = record.end.offset
        size = file.stat().st_size
        if size > good:
            logger.warning(
                "spool %s: dropping a torn record of %d bytes at the end of %s", self.path, size - good, file.name
            )
            os.truncate(file, good)

    # --- reading and acknowledging --------------------------------------------------------

    def pending(self, limit: int) -> list[Record]:
        """Up to ``limit`` unacknowledged records, oldest first; they are in flight until acked or released.

        Segments holding records in flight are never dropped by the caps (they are being delivered).
        Records held in memory (the disk refused them) come after every record on disk.
        """
        with self._lock:
            out: list[Record] = []
            for number in self.segments():
                if number < self._cursor.segment:
                    continue
                start = self._cursor.offset if number == self._cursor.segment else 0
                for record in scan(self._segment_path(number), start, number=number):
                    out.append(record)
                    if len(out) >= limit:
                        break
                if len(out) >= limit:
                    break
            self._in_flight = out[-1].end.segment if out else None
            self._disk_end_in_flight = out[-1].end if out else None
            return out + self._memory.take(limit - len(out))

    def release(self) -> None:
        """The records in flight were not delivered; they stay pending."""
        with self._lock:
            self._in_flight = None
            self._memory.in_flight = 0

    def ack(self, upto: Position) -> None:
        """Everything before ``upto`` is delivered: move the cursor, delete finished segments."""
        with self._lock:
            self._in_flight = None
            self._memory.in_flight = 0
            if upto.segment >= MEMORY_SEGMENTS:  # held records: every disk record sent with them is delivered too
                self._memory.ack(upto)
                if self._disk_end_in_flight is None:
                    return
                upto = self._disk_end_in_flight
            if (upto.segment, upto.offset) > (self._cursor.segment, self._cursor.offset):
                self._cursor = upto
                self._save_cursor()
            for number in self.segments():
                if number < self._cursor.segment and number != self._segment:
                    _unlink(self._segment_path(number))

    def make_room(self, incoming: int = 0, now: float | None = None) -> int:
        """Drop the oldest undelivered segments beyond the caps, counting ``incoming`` bytes about to be
        appended; segments in flight and the one being written are kept. Returns the reports dropped."""
        now = time.time() if now is None else now
        with self._lock:
            dropped = 0
            segments = [n for n in self.segments() if n >= self._cursor.segment]
            stats = {n: _stat(self._segment_path(n)) for n in segments}
            total = sum(s.st_size for s in stats.values() if s is not None) + incoming
            for number in segments:
                if number == self._segment:  # never the segment being written
                    break
                stat = stats[number]
                if stat is None or (self._in_flight is not None and number <= self._in_flight):
                    continue
                file = self._segment_path(number)
                too_old = now - stat.st_mtime > self.max_age
                if total <= self.max_bytes and not too_old:
                    break
                start = self._cursor.offset if number == self._cursor.segment else 0
                count = sum(1 for _ in scan(file, start, number=number))
                dropped += count
                total -= stat.st_size
                _unlink(file)
                if number == self._cursor.segment:
                    self._cursor = Position(number + 1, 0)
                logger.warning(
                    "spool %s: dropped %d undelivered reports (%s cap)", self.path, count, "age" if too_old else "size"
                )
            if dropped:
                self.dropped += dropped
                self._save_cursor()
            return dropped

    def count_dropped(self, count: int) -> None:
        """``count`` reports never appended (the GPU host-copy writer could not take them) join the dropped count."""
        with self._lock:
            self.dropped += count
            self._save_cursor()

    def bytes_pending(self) -> int:
        """Bytes not yet delivered, on disk and in memory. Takes no lock (the training thread calls it):
        a segment the sender deletes meanwhile counts as delivered."""
        cursor = self._cursor  # one read: the sender replaces it, never changes it
        total = self._memory.bytes
        for number in self.segments():
            if number >= cursor.segment:
                stat = _stat(self._segment_path(number))
                if stat is not None:
                    total += max(0, stat.st_size - (cursor.offset if number == cursor.segment else 0))
        return total

    def segments(self) -> list[int]:
        return [number for number, _ in segment_files(self.path, self._stray)]

    def close(self) -> None:
        """Spool what memory holds if the disk takes it now (else it is lost, counted, with a warning); unlock."""
        if self._closed:
            return
        with self._lock:
            if self._memory:
                self._memory.in_flight = 0
                self._write_or_hold([], now=True)
            if self._memory:
                lost = len(self._memory)
                logger.warning(
                    "qkwatch: spool %s: %d report(s) held in memory are lost (disk refused)", self.path, lost
                )
                self.dropped += lost
                self._save_cursor()
                self._memory.clear()
            self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._owner is not None:
            self._owner.release()

    def _segment_path(self, number: int) -> Path:
        return self.path / f"seg-{number:08d}.log"

    def _stray(self, file: Path) -> None:
        self._warn_once(f"stray:{file.name}", "spool %s: ignoring %s (not a segment)", self.path, file.name)


def _unlink(path: Path) -> None:
    """Delete a segment; on a disk turned read-only it stays (delivered or dropped all the same)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _stat(path: Path) -> os.stat_result | None:
    """``path``'s stat, or None if the sender deleted it meanwhile."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def encode_record(payload: dict[str, Any]) -> bytes:
    """A record's bytes as the spool stores them (compact JSON; NaN and infinities refused)."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
