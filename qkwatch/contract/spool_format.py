"""The spool's record format: what the agent appends to its segment files and every reader scans.

A record is ``MAGIC | u32 length | u32 crc32(payload) | payload`` (little endian; the payload is
one JSON object: ``{"attempt_key", "report"}`` or an end status). The agent's spool
(``qkwatch.agent.disk_spool``) writes and acknowledges records; ``qkwatch sync`` delivers them; the
offline reader (:mod:`qkwatch.contract.offline_reports`) and ``qkwatch report --spool`` read them
with no collector. Standard library only, so a reader needs neither torch nor the collector.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"QKW1"
HEADER = struct.Struct("<4sII")  # magic, length, crc32
MAX_RECORD = 64 * 2**20
SEGMENT_GLOB = "seg-*.log"
"""Segment files of one spool directory, numbered in the order they were written."""


@dataclass(frozen=True)
class Position:
    segment: int
    offset: int

    def as_dict(self) -> dict[str, int]:
        return {"segment": self.segment, "offset": self.offset}


@dataclass(frozen=True)
class Record:
    start: Position
    end: Position
    payload: dict[str, Any]


def segment_number(path: Path) -> int:
    """``seg-00000012.log`` -> 12."""
    return int(path.stem.split("-")[1])


def scan(file: Path, offset: int, *, number: int = 0, damaged: Callable[[], None] | None = None) -> Iterator[Record]:
    """Records of one segment from ``offset``; stops at a torn tail, resynchronises after corruption.

    Args:
        damaged: called once per stretch of corrupt bytes skipped (a torn tail is not counted: it
            is a record still being written, or the one a killed writer lost).
    """
    try:
        with open(file, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return
    pos = 0
    while pos + HEADER.size <= len(data):
        magic, length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if magic == MAGIC and length <= MAX_RECORD and end > len(data) and not _good_record_after(data, pos + 1):
            return  # torn tail, or a record still being written (a length past good records: corruption)
        if magic == MAGIC and length <= MAX_RECORD:
            payload = data[pos + HEADER.size : end]
            if zlib.crc32(payload) == crc:
                try:
                    value = json.loads(payload)
                except ValueError:
                    value = None
                if isinstance(value, dict):
                    yield Record(Position(number, offset + pos), Position(number, offset + end), value)
                    pos = end
                    continue
        nxt = data.find(MAGIC, pos + 1)
        skipped = (nxt if nxt >= 0 else len(data)) - pos
        logger.warning("spool %s: skipping %d corrupt bytes at offset %d", file, skipped, offset + pos)
        if damaged is not None:
            damaged()
        if nxt < 0:
            return
        pos = nxt


def _good_record_after(data: bytes, start: int) -> bool:
    """Whether a whole record with a good checksum begins at or after ``start``.

    Appends are sequential, so a torn tail is never followed by a whole record: a header whose
    length runs past one is a corrupted length field, not a record still being written.
    """
    nxt = data.find(MAGIC, start)
    while nxt >= 0 and nxt + HEADER.size <= len(data):
        _, length, crc = HEADER.unpack_from(data, nxt)
        end = nxt + HEADER.size + length
        if length <= MAX_RECORD and end <= len(data) and zlib.crc32(data[nxt + HEADER.size : end]) == crc:
            return True
        nxt = data.find(MAGIC, nxt + 1)
    return False
