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
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkwatch.agent.checks import positive_ints, positive_seconds
from qkwatch.contract.spool_format import (
    HEADER,
    MAGIC,
    MAX_RECORD,
    SEGMENT_GLOB,
    Position,
    Record,
    scan,
    segment_number,
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


class Spool:
    """One directory of records; safe for one writer thread and one reader thread of one process."""

    def __init__(
        self,
        path: str | Path,
        *,
        segment_bytes: int = SpoolConfig.segment_bytes,
        max_bytes: int = SpoolConfig.spool_max_bytes,
        max_age: float = SpoolConfig.spool_max_age_seconds,
    ):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolLocked(f"{self.path} is in use by another process (a running agent or qkwatch sync)") from None
        state = _read_json(self.path / "cursor.json") or {}
        self._cursor = Position(int(state.get("segment", 0)), int(state.get("offset", 0)))
        self.dropped = int(state.get("dropped", 0))
        self._fd: int | None = None
        self._lock = threading.Lock()  # the cursor: the writer's caps against the sender's acks
        self._in_flight: int | None = None
        self._segment = 0
        self._size = 0
        self._closed = False
        self._recover_tail()

    # --- metadata -------------------------------------------------------------------------

    def read_meta(self) -> dict[str, Any]:
        return _read_json(self.path / "meta.json") or {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        _write_json_atomic(self.path / "meta.json", meta)

    # --- writing --------------------------------------------------------------------------

    def append(self, payload: dict[str, Any]) -> None:
        """Append one record (one ``write`` call). Raises OSError if the disk refuses."""
        self.append_encoded([encode_record(payload)])

    def append_encoded(self, records: list[bytes]) -> None:
        """Append records made by :func:`encode_record`, in order, with one ``write`` call (a report and
        the scalar-only reports of the steps before it). Raises OSError if the disk refuses; a write
        cut short by a kill leaves whole records and a torn tail, which the next open truncates."""
        for data in records:
            if len(data) > MAX_RECORD:
                raise ValueError(f"a report of {len(data)} bytes exceeds the spool's record limit of {MAX_RECORD}")
        if not records:
            return
        fd = self._fd
        if fd is None or self._size >= self.segment_bytes:
            fd = self._open_segment(self._segment + 1 if fd is not None else max(self._segment, 1))
        blob = b"".join(HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data for data in records)
        os.write(fd, blob)
        self._size += len(blob)

    def _open_segment(self, number: int) -> int:
        """Close the current segment and open segment ``number`` for appending; returns its fd."""
        if self._fd is not None:
            os.close(self._fd)
        self._segment = number
        file = self._segment_path(number)
        self._fd = fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(fd).st_size
        return fd

    def _recover_tail(self) -> None:
        """Truncate a torn record at the end of the newest segment (a writer killed mid-write)."""
        segments = self.segments()
        if not segments:
            self._segment = max(self._cursor.segment, 0)
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
            return out

    def release(self) -> None:
        """The records in flight were not delivered; they stay pending."""
        with self._lock:
            self._in_flight = None

    def ack(self, upto: Position) -> None:
        """Everything before ``upto`` is delivered: move the cursor, delete finished segments."""
        with self._lock:
            self._in_flight = None
            if (upto.segment, upto.offset) > (self._cursor.segment, self._cursor.offset):
                self._cursor = upto
                self._save_cursor()
            for number in self.segments():
                if number < self._cursor.segment and number != self._segment:
                    self._segment_path(number).unlink(missing_ok=True)

    def make_room(self, incoming: int = 0, now: float | None = None) -> int:
        """Drop the oldest undelivered segments beyond the caps, counting ``incoming`` bytes about to be
        appended; segments in flight and the one being written are kept. Returns the reports dropped."""
        now = time.time() if now is None else now
        with self._lock:
            dropped = 0
            segments = [n for n in self.segments() if n >= self._cursor.segment]
            sizes = {n: self._segment_path(n).stat().st_size for n in segments}
            total = sum(sizes.values()) + incoming
            for number in segments:
                if number == self._segment:  # never the segment being written
                    break
                if self._in_flight is not None and number <= self._in_flight:
                    continue
                file = self._segment_path(number)
                too_old = now - file.stat().st_mtime > self.max_age
                if total <= self.max_bytes and not too_old:
                    break
                start = self._cursor.offset if number == self._cursor.segment else 0
                count = sum(1 for _ in scan(file, start, number=number))
                dropped += count
                total -= sizes[number]
                file.unlink(missing_ok=True)
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
        total = 0
        for number in self.segments():
            if number >= self._cursor.segment:
                size = self._segment_path(number).stat().st_size
                total += size - (self._cursor.offset if number == self._cursor.segment else 0)
        return total

    def dead_letter(self, entry: dict[str, Any]) -> None:
        with open(self.path / "dead-letter.jsonl", "a") as fh:
            fh.write(json.dumps(entry, allow_nan=False) + "\n")

    def segments(self) -> list[int]:
        return sorted(segment_number(p) for p in self.path.glob(SEGMENT_GLOB))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    def _save_cursor(self) -> None:
        _write_json_atomic(self.path / "cursor.json", {**self._cursor.as_dict(), "dropped": self.dropped})

    def _segment_path(self, number: int) -> Path:
        return self.path / f"seg-{number:08d}.log"


def encode_record(payload: dict[str, Any]) -> bytes:
    """A record's bytes as the spool stores them (compact JSON; NaN and infinities refused)."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value: dict[str, Any] = json.loads(path.read_text())  # this module writes only objects
    except FileNotFoundError:
        return None
    except ValueError:
        logger.warning("%s is not valid JSON; ignoring it", path)
        return None
    return value


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, allow_nan=False))
    os.replace(tmp, path)
