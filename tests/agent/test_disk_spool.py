"""The write-ahead spool: records survive, torn tails cost only themselves, caps drop and count."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from qkwatch.agent.shipping.disk_spool import Spool, SpoolLocked


def reports(spool: Spool) -> list[int]:
    steps = [r.payload["step"] for r in spool.pending(10_000)]
    spool.release()  # only looked at, not sent
    return steps


def test_append_pending_ack_and_segment_rotation(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=200)
    for step in range(20):
        spool.append({"step": step, "pad": "x" * 40})
    assert len(spool.segments()) > 3
    first = spool.pending(7)
    assert [r.payload["step"] for r in first] == list(range(7))
    spool.ack(first[-1].end)
    assert reports(spool)[0] == 7
    rest = spool.pending(100)
    spool.ack(rest[-1].end)
    assert reports(spool) == [] and spool.bytes_pending() == 0
    assert len(spool.segments()) <= 2  # delivered segments are deleted
    spool.close()
    reopened = Spool(tmp_path, segment_bytes=200)  # the cursor persists
    assert reports(reopened) == []
    reopened.append({"step": 20})
    assert reports(reopened) == [20]


def test_one_owner_at_a_time(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    with pytest.raises(SpoolLocked, match="in use by another process"):
        Spool(tmp_path)
    spool.close()
    spool.close()  # idempotent
    Spool(tmp_path).close()


def test_a_torn_tail_loses_only_itself(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for step in range(5):
        spool.append({"step": step})
    spool.close()
    (segment,) = tmp_path.glob("seg-*.log")
    size = segment.stat().st_size
    os.truncate(segment, size - 3)  # the writer died inside the last record
    reopened = Spool(tmp_path)
    assert reports(reopened) == [0, 1, 2, 3]
    reopened.append({"step": 5})  # appended after the truncated tail, not after garbage
    assert reports(reopened) == [0, 1, 2, 3, 5]


def test_corruption_in_the_middle_is_skipped(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    for step in range(4):
        spool.append({"step": step, "payload": "abcdefgh"})
    spool.close()
    (segment,) = tmp_path.glob("seg-*.log")
    data = bytearray(segment.read_bytes())
    middle = data.find(b'"step":1')
    data[middle + 2] ^= 0xFF  # a flipped bit: the checksum fails
    segment.write_bytes(bytes(data))
    assert reports(Spool(tmp_path)) == [0, 2, 3]


def records_of(path: Path) -> list[tuple[int, bytes]]:
    """(offset, payload) of each record of a segment, parsed here from the documented format
    ``MAGIC | u32 length | u32 crc32(payload) | payload`` (little endian), not with the spool's reader."""
    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        assert data[pos : pos + 4] == b"QKW1"
        (length,) = struct.unpack_from("<I", data, pos + 4)
        out.append((pos, data[pos + 12 : pos + 12 + length]))
        pos += 12 + length
    return out


def test_a_changed_digit_that_leaves_valid_json_is_caught_by_the_checksum(tmp_path: Path) -> None:
    """Corruption the JSON parser cannot see: only the CRC tells the changed record from a good one."""
    written = [{"step": step, "loss": 0.125 + step} for step in range(4)]
    spool = Spool(tmp_path)
    for payload in written:
        spool.append(payload)
    spool.close()
    (segment,) = tmp_path.glob("seg-*.log")
    offset, payload = records_of(segment)[1]
    data = bytearray(segment.read_bytes())
    digit = offset + 12 + payload.index(b"1.125") + 2  # "1.125" -> "1.725": still a valid report
    data[digit : digit + 1] = b"7"
    assert json.loads(data[offset + 12 : offset + 12 + len(payload)]) == {"step": 1, "loss": 1.725}
    segment.write_bytes(bytes(data))
    survivors = [r.payload for r in Spool(tmp_path).pending(100)]
    assert survivors == [written[0], written[2], written[3]]  # the changed one is dropped, not delivered


@pytest.mark.parametrize("delta", [-1, 1, 7, 10_000])
def test_a_corrupted_length_field_in_the_middle_loses_only_that_record(tmp_path: Path, delta: int) -> None:
    """A wrong length, shorter, longer, or past the end of the segment (which must not be taken for
    a torn tail: the records after it are intact and must be neither skipped nor truncated)."""
    spool = Spool(tmp_path)
    for step in range(4):
        spool.append({"step": step, "loss": 0.5})
    spool.close()
    (segment,) = tmp_path.glob("seg-*.log")
    offset, payload = records_of(segment)[1]
    data = bytearray(segment.read_bytes())
    struct.pack_into("<I", data, offset + 4, len(payload) + delta)
    segment.write_bytes(bytes(data))
    size = len(data)
    reopened = Spool(tmp_path)  # a new owner: recovers the tail of the newest segment
    assert reports(reopened) == [0, 2, 3]
    assert segment.stat().st_size == size  # nothing after the damaged record was cut off as a "torn tail"
    reopened.append({"step": 4})
    assert reports(reopened) == [0, 2, 3, 4]


def test_size_cap_drops_oldest_segments_and_counts(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=300, max_bytes=700)
    for step in range(40):
        spool.append({"step": step, "pad": "y" * 30})
    before = len(reports(spool))
    dropped = spool.make_room()
    after = reports(spool)
    assert dropped > 0 and len(after) == before - dropped
    assert after == list(range(40 - len(after), 40))  # the newest survive, in order
    assert spool.bytes_pending() <= 700 + 300
    spool.close()
    assert Spool(tmp_path).dropped == dropped  # the count persists


def test_age_cap(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=100, max_age=3600)
    for step in range(10):
        spool.append({"step": step, "pad": "z" * 40})
    old = time.time() - 7200
    for number in spool.segments()[:-1]:
        os.utime(tmp_path / f"seg-{number:08d}.log", (old, old))
    dropped = spool.make_room()
    survivors = reports(spool)
    assert dropped == 10 - len(survivors) and dropped > 0
    assert survivors == list(range(10 - len(survivors), 10))  # only the segment still being written


def test_records_in_flight_are_not_dropped(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=300, max_bytes=700)
    for step in range(40):
        spool.append({"step": step, "pad": "y" * 30})
    in_flight = spool.pending(3)  # the sender is posting the three oldest
    spool.make_room()
    survivors = reports(spool)
    assert survivors[:3] == [0, 1, 2]  # never dropped while in flight
    spool.ack(in_flight[-1].end)
    assert reports(spool)[0] > 2
