"""Records the disk refused, held in memory until it takes them again or the sender delivers them.

The spool (``agent.shipping.disk_spool``) holds here what a full or read-only disk refuses (ENOSPC, EROFS,
a short write): in order, up to ``max_bytes``, beyond which the oldest not in flight are dropped
(the spool counts them). The sender reads them after every record on disk, at positions in a
segment number no file has (at or above :data:`MEMORY_SEGMENTS`, random per process, so their
batch ids are no other process's). Each write tries the disk again, at most every
:data:`RETRY_SECONDS`; once it takes one, what is held goes first, in order. One warning when the
disk refuses, one when memory is full. Not thread-safe: the spool's lock guards it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from qkwatch.contract.spool_format import HEADER, MAGIC, Position, Record

logger = logging.getLogger(__name__)

MEMORY_MAX_BYTES = 64 * 2**20
"""Reports held in memory while the disk refuses them, at most (bytes); beyond, the oldest are dropped and counted."""
RETRY_SECONDS = 1.0
"""While the disk refuses writes, it is tried again at most this often."""
MEMORY_SEGMENTS = 2**40
"""Positions of records held in memory have a segment number at or above this (never a file)."""


class HeldRecords:
    """Encoded records in the order written, each with its own position; and whether the disk refuses."""

    def __init__(self, path: Path, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = MEMORY_MAX_BYTES if max_bytes is None else max_bytes
        self.bytes = 0
        self.in_flight = 0
        """How many of the oldest the sender has (they keep their places until acked or released)."""
        self.error: str | None = None
        """Why the disk refuses writes; None while it takes them."""
        self._records: list[tuple[Position, Position, bytes]] = []
        self._segment = MEMORY_SEGMENTS + secrets.randbits(32)
        self._next = 0
        self._retry_at = 0.0
        self._warned_full = False

    def __len__(self) -> int:
        return len(self._records)

    def refused(self, exc: OSError, what: str) -> None:
        """The disk refused: hold records from now on (one warning until it takes them again)."""
        self._retry_at = time.monotonic() + RETRY_SECONDS
        if self.error is None:
            self.error = f"{what}: {exc}"
            logger.warning(
                "qkwatch: spool %s: %s (%s); holding up to %s of reports in memory, delivered from there "
                "(beyond it the oldest are dropped and counted) until the disk takes them again",
                self.path,
                what,
                exc,
                _mib(self.max_bytes),
            )

    def write_or_hold(self, write: Callable[[bytes], None] | None, records: list[bytes], *, now: bool = False) -> int:
        """Write what is held and ``records`` if it is time to try and ``write`` succeeds, else hold them.

        Args:
            write: appends bytes whole or raises OSError; None: the disk is not tried.
            now: try even before the retry time.

        Returns:
            The records dropped to stay within the bound.
        """
        if write is not None and not self.in_flight and (now or time.monotonic() >= self._retry_at):
            held = self.framed()
            try:
                write(b"".join(held + [framed(data) for data in records]))
            except OSError:
                self._retry_at = time.monotonic() + RETRY_SECONDS
            else:
                logger.info(
                    "qkwatch: spool %s: the disk takes reports again; %d held are spooled", self.path, len(held)
                )
                self.clear()
                self.error = None
                return 0
        return self.hold(records)

    def hold(self, records: list[bytes]) -> int:
        """Keep ``records``; beyond the bound drop the oldest not in flight (never the newest). Returns the drops."""
        for data in records:
            start = Position(self._segment, self._next)
            self._next += HEADER.size + len(data)
            self._records.append((start, Position(self._segment, self._next), data))
            self.bytes += len(data)
        dropped = 0
        while self.bytes > self.max_bytes and len(self._records) > self.in_flight + 1:
            self.bytes -= len(self._records.pop(self.in_flight)[2])
            dropped += 1
        if dropped and not self._warned_full:
            self._warned_full = True
            logger.warning(
                "qkwatch: spool %s: %s of reports in memory; dropping the oldest (counted in agent_dropped_total)",
                self.path,
                _mib(self.max_bytes),
            )
        return dropped

    def take(self, limit: int) -> list[Record]:
        """Up to ``limit`` of the oldest, now in flight."""
        taken = self._records[: max(0, limit)]
        self.in_flight = len(taken)
        return [Record(start, end, json.loads(data)) for start, end, data in taken]

    def ack(self, upto: Position) -> None:
        """Those before ``upto`` (a position of :meth:`take`) are delivered."""
        self.in_flight = 0
        while self._records and upto.segment == self._segment and self._records[0][1].offset <= upto.offset:
            self.bytes -= len(self._records.pop(0)[2])

    def framed(self) -> list[bytes]:
        """Every record held, framed for a segment (they stay held until :meth:`clear`)."""
        return [framed(data) for _, _, data in self._records]

    def clear(self) -> None:
        self._records.clear()
        self.bytes = self.in_flight = 0


def framed(data: bytes) -> bytes:
    """A record's bytes as a segment holds them: ``MAGIC | u32 length | u32 crc32 | payload``."""
    return HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data


def _mib(size: int) -> str:
    return f"{size / 2**20:.3g} MiB"
