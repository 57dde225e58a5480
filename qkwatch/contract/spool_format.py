"""The spool's format: the records the agent appends to its segment files and every reader scans,
and what ``cursor.json`` and ``meta.json`` may hold.

A record is ``MAGIC | u32 length | u32 crc32(payload) | payload`` (little endian; the payload is
one JSON object: ``{"attempt_key", "report"}`` or an end status). The agent's spool
(``qkwatch.agent.shipping.disk_spool``) writes and acknowledges records; ``qkwatch sync`` delivers them; the
offline reader (:mod:`qkwatch.contract.offline_reports`) and ``qkwatch report --spool`` read them
with no collector. Standard library only, so a reader needs neither torch nor the collector.
"""

from __future__ import annotations

import json
import logging
import re
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
SEGMENT_GLOB = "seg-" + "[0-9]" * 8 + ".log"
"""Segment files of one spool directory, numbered in the order they were written (a stray
``seg-backup.log`` is not one)."""
SEGMENT_NAME = re.compile(r"seg-(\d{8})\.log")
MAX_SEGMENT = 10**8 - 1
"""The largest segment number a name of :data:`SEGMENT_GLOB` can carry."""


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


def segment_files(directory: Path, stray: Callable[[Path], None] | None = None) -> list[tuple[int, Path]]:
    """The segments of one spool directory as ``(number, path)``, oldest first.

    Args:
        stray: called with each file named like a segment that is not one (``seg-backup.log``).
    """
    found = []
    for file in directory.glob("seg-*.log"):
        match = SEGMENT_NAME.fullmatch(file.name)
        if match:
            found.append((int(match[1]), file))
        elif stray is not None:
            stray(file)
    return sorted(found)


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


META_FIELDS: dict[str, tuple[type, ...]] = {
    "spool_id": (str,),
    "run_id": (str,),
    "url": (str, type(None)),
    "project": (str,),
    "name": (str,),
    "config": (dict,),
    "attempt_key": (str, type(None)),
    "tags": (list,),
    "notes": (str, type(None)),
    "rank": (int,),
}
"""The fields of ``meta.json`` and their types."""


def clean_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``meta`` without its fields of the wrong type, and their names."""
    wrong = sorted(k for k, v in meta.items() if k in META_FIELDS and not _is(v, META_FIELDS[k]))
    return {k: v for k, v in meta.items() if k not in wrong}, wrong


def cursor_of(state: dict[str, Any]) -> tuple[Position | None, int | None]:
    """``cursor.json``'s position and dropped count; None for either that is damaged (not a
    non-negative integer, or a position past :data:`MAX_SEGMENT`)."""
    segment: Any = state.get("segment")
    offset: Any = state.get("offset")
    dropped: Any = state.get("dropped", 0)
    good = _is_count(segment) and _is_count(offset) and segment <= MAX_SEGMENT
    return (Position(segment, offset) if good else None), (dropped if _is_count(dropped) else None)


def checked_cursor(directory: Path, cursor: Position, segments: list[int]) -> tuple[Position, str | None]:
    """``cursor`` if it is the end of a record of its segment (or 0), else a repair and what was wrong.

    A cursor past the records on disk would skip the next reports written: it becomes "nothing
    delivered" (0, 0); one inside a record moves back to the record's start; one in a segment that
    is gone, to that segment's start.
    """
    if segments and cursor.segment > segments[-1]:
        return Position(0, 0), "points past the last segment"
    if cursor.offset == 0:
        return cursor, None
    if cursor.segment not in segments:
        return Position(cursor.segment, 0), "points into a segment that is gone"
    file = directory / f"seg-{cursor.segment:08d}.log"
    ends = [0] + [r.end.offset for r in scan(file, 0, number=cursor.segment)]
    if cursor.offset in ends:
        return cursor, None
    if cursor.offset > file.stat().st_size:
        return Position(0, 0), f"points past the end of {file.name}"
    return Position(cursor.segment, max(e for e in ends if e < cursor.offset)), f"points inside a record of {file.name}"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)
