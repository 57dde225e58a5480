"""The disk under the training run: full, nearly full, read-only, damaged, shared with forked children.

A tiny training loop with an attached agent must finish every step whatever the disk does, say so
once, count what it had to drop, and deliver the rest. The real faults run on a small tmpfs
(``small_disk``: CI runs as root; elsewhere those tests skip unless CI=true, where they fail
instead); short writes and an ENOSPC at a chosen moment are injected with ``faulty_os`` (the spool
module's ``os`` with a ``write`` that misbehaves). Both fixtures are in ``conftest.py``; the suite
of every fault against one training loop is ``test_fault_injection.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import qkwatch
from qkwatch import agent
from qkwatch.agent.shipping import spool_memory
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.faults import FaultyOs
from tests.agent.test_delivery import assert_exactly_once, points
from tests.agent.tiny import TinyGPT, train
from tests.live import ROOT, LiveCollector

FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def attach(spool: Path, run: str = "disk", url: str | None = None, **settings: Any) -> tuple[agent.Agent, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    settings = {**FAST, **settings}
    return agent.attach(model, url=url, project="tests", run=run, spool=str(spool), every=1, **settings), model


def finish(a: agent.Agent) -> None:
    """Close an offline agent and make sure its spool is let go (an offline close does not wait for the sender)."""
    a.close(timeout=0)
    a.sender.close(5)
    a.spool.close()


def rank_dir(spool: Path, run: str = "disk") -> Path:
    return spool / "tests" / run / "rank-0"


def pending_steps(path: Path) -> list[int]:
    """The steps the spool at ``path`` would deliver next (what a sender sends)."""
    spool = Spool(path)
    try:
        return [r.payload["report"]["step"] for r in spool.pending(10**6) if "report" in r.payload]
    finally:
        spool.close()


# --- a full disk -------------------------------------------------------------------------------


def test_a_full_disk_never_stops_the_step_drops_are_counted_and_spooling_resumes(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real ENOSPC: the disk fills at a step, reports wait in a bounded memory, the oldest of them
    are dropped and counted in ``agent_dropped_total``, and when space returns every later report
    is spooled again."""
    monkeypatch.setattr(spool_memory, "MEMORY_MAX_BYTES", 20_000)
    monkeypatch.setattr(spool_memory, "RETRY_SECONDS", 0.0)
    caplog.set_level(logging.WARNING)
    spool = small_disk / "spool"
    filler = small_disk / "filler"
    a, model = attach(spool)
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 48 * 1024))  # room for a few reports only
    train(a, model, 60)  # raised ENOSPC out of step() before
    assert len(warnings_with(caplog, "the disk refused")) == 1
    filler.unlink()  # space returns
    train(a, model, 80, start=60)
    finish(a)
    read = qkwatch.read_reports(spool)
    missing = sorted(set(range(80)) - set(read.steps))
    assert missing, "the memory bound was reached: some reports were dropped"
    assert set(range(60, 80)) <= set(read.steps)  # spooled again once space returned
    assert read.reports[-1].scalars["agent_dropped_total"] == len(missing)  # each drop counted
    assert len(warnings_with(caplog, "the disk refused")) == 1


def test_a_full_disk_with_a_collector_delivers_from_memory_and_loses_nothing(
    tmp_path: Path, collector: LiveCollector, faulty_os: FaultyOs, caplog: pytest.LogCaptureFixture
) -> None:
    collector.start()
    caplog.set_level(logging.WARNING)
    a, model = attach(tmp_path / "spool", run="full", url=collector.url)
    train(a, model, 8)
    faulty_os.full = True  # every write of a report fails from here
    train(a, model, 20, start=8)
    faulty_os.full = False
    train(a, model, 30, start=20)
    a.close(timeout=60)
    rows = points(collector, "full")
    assert_exactly_once(rows, range(30))
    assert {r["value"] for r in rows if r["metric"] == "agent_dropped_total"} == {0.0}
    assert len(warnings_with(caplog, "the disk refused")) == 1
    assert pending_steps(rank_dir(tmp_path / "spool", "full")) == []


@pytest.mark.parametrize("then_full", [False, True], ids=["short", "short-then-full"])
def test_a_short_write_is_finished_or_undone(tmp_path: Path, faulty_os: FaultyOs, then_full: bool) -> None:
    """``os.write`` may write part of what it was given: the rest is written, or (when the disk then
    refuses) the part is cut off again and the records wait in memory, to follow in order."""
    spool = Spool(tmp_path)
    faulty_os.short = True
    for step in range(10):
        spool.append({"step": step, "pad": "x" * 50})
    faulty_os.full = then_full
    for step in range(10, 20):
        spool.append({"step": step, "pad": "x" * 50})
    faulty_os.full = faulty_os.short = False
    spool.append({"step": 20})
    spool.close()
    assert [r.payload["step"] for r in Spool(tmp_path).pending(100)] == list(range(21))


def test_reports_held_in_memory_are_bounded_and_the_drops_counted(tmp_path: Path, faulty_os: FaultyOs) -> None:
    spool = Spool(tmp_path, memory_max_bytes=1000)
    faulty_os.full = True
    for step in range(50):
        spool.append({"step": step, "pad": "y" * 80})
    held = [r.payload["step"] for r in spool.pending(100)]
    spool.release()
    assert spool.bytes_pending() <= 1000
    assert held == list(range(50 - len(held), 50)) and spool.dropped == 50 - len(held) > 0  # the newest kept
    faulty_os.full = False
    spool.close()  # what memory holds goes to disk
    reopened = Spool(tmp_path)
    assert [r.payload["step"] for r in reopened.pending(100)] == held and reopened.dropped == 50 - len(held)


# --- a spool that cannot be used ---------------------------------------------------------------


def test_an_unusable_spool_directory_warns_and_the_run_trains_and_delivers(
    tmp_path: Path, collector: LiveCollector, caplog: pytest.LogCaptureFixture
) -> None:
    """The spool root is a file, not a folder (what a read-only disk does to a non-root user alike)."""
    collector.start()
    caplog.set_level(logging.WARNING)
    (tmp_path / "spool").write_text("not a folder")
    a, model = attach(tmp_path / "spool", run="nospool", url=collector.url)
    train(a, model, 10)
    a.close(timeout=60)
    assert_exactly_once(points(collector, "nospool"), range(10))
    assert len(warnings_with(caplog, "cannot be used")) == 1


def test_a_read_only_spool_warns_and_the_run_trains_and_delivers(
    small_disk: Path, collector: LiveCollector, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk turns read-only between two runs: the second trains, delivers the first run's reports
    from the read-only disk (its sender cannot delete what it delivered, and carries on) and its own
    from memory."""
    caplog.set_level(logging.WARNING)
    spool = small_disk / "spool"
    first, model = attach(spool, run="ro", segment_bytes=1000)  # a segment a report
    train(first, model, 3)
    finish(first)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    collector.start()
    a, model = attach(spool, run="ro", url=collector.url)  # raised OSError (EROFS) before
    train(a, model, 10, start=3)
    a.close(timeout=60)
    assert_exactly_once(points(collector, "ro"), range(10))
    assert len(warnings_with(caplog, "cannot be used")) == 1
    assert qkwatch.read_reports(spool).steps == [0, 1, 2]  # the disk as it was


# --- forks and locks ---------------------------------------------------------------------------

FORKING_TRAINER = """
import multiprocessing, sys, time
from qkwatch.agent.shipping.disk_spool import Spool
spool = Spool(sys.argv[1])
spool.append({"step": 0})
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_forked_child_does_not_hold_the_lock_after_its_parent_is_killed(tmp_path: Path) -> None:
    """A DataLoader worker (a forked child) outlives the trainer's SIGKILL: the resumed run takes the
    spool at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_TRAINER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait(10)
        spool = Spool(tmp_path)  # raised SpoolLocked until the child exited
        assert [r.payload["step"] for r in spool.pending(10)] == [0]
        spool.close()
    finally:
        os.kill(child, signal.SIGKILL)


# --- bytes_pending while the sender deletes ----------------------------------------------------


def test_bytes_pending_never_raises_while_the_sender_deletes_segments(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=120)
    stop = threading.Event()

    def sender() -> None:
        while not stop.is_set():
            records = spool.pending(3)
            if records:
                spool.ack(records[-1].end)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 3.0
        calls = 0
        while time.monotonic() < deadline:
            spool.append({"step": calls, "pad": "z" * 60})
            assert spool.bytes_pending() >= 0  # raised FileNotFoundError within ~100 calls before
            calls += 1
    finally:
        stop.set()
        thread.join(5)
    assert calls > 1000
    spool.close()


# --- damaged metadata --------------------------------------------------------------------------


def _cursor(path: Path, value: Any) -> None:
    (path / "cursor.json").write_text(json.dumps(value))


def _segment(path: Path) -> Path:
    return sorted(path.glob("seg-*.log"))[-1]


DAMAGE: dict[str, Callable[[Path], object]] = {
    "cursor-segment-not-an-integer": lambda p: _cursor(p, {"segment": "one", "offset": 0, "dropped": 0}),
    "cursor-offset-a-float": lambda p: _cursor(p, {"segment": 1, "offset": 1.5, "dropped": 0}),
    "cursor-dropped-negative": lambda p: _cursor(p, {"segment": 1, "offset": 0, "dropped": -3}),
    "cursor-an-array": lambda p: _cursor(p, [1]),
    "cursor-past-the-segment-end": lambda p: _cursor(p, {"segment": 1, "offset": 10**9, "dropped": 0}),
    "cursor-past-the-last-segment": lambda p: _cursor(p, {"segment": 10**12, "offset": 0, "dropped": 0}),
    "cursor-inside-a-record": lambda p: _cursor(p, {"segment": 1, "offset": 7, "dropped": 0}),
    "meta-an-array": lambda p: (p / "meta.json").write_text("[1]"),
    "meta-fields-of-the-wrong-type": lambda p: (p / "meta.json").write_text(
        json.dumps({"run_id": 5, "spool_id": [1], "rank": "zero", "project": None})
    ),
    "stray-segment-file": lambda p: (p / "seg-backup.log").write_bytes(b"not a segment"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_spool_metadata_warns_and_skips_no_report_of_the_next_run(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    spool = tmp_path / "spool"
    first, model = attach(spool)
    train(first, model, 5)
    finish(first)
    DAMAGE[damage](rank_dir(spool))
    caplog.set_level(logging.WARNING)
    a, model = attach(spool)  # raised before for a non-integer position, [1] and the stray file
    train(a, model, 25, start=5)
    finish(a)
    assert warnings_with(caplog, "spool")
    assert pending_steps(rank_dir(spool)) == list(range(25))  # none skipped, the first run's included
    read = qkwatch.read_reports(spool)
    assert read.steps == list(range(25)) and read.reports[-1].scalars["agent_dropped_total"] == 0
    meta = json.loads((rank_dir(spool) / "meta.json").read_text())
    assert isinstance(meta["spool_id"], str) and isinstance(meta.get("run_id", ""), str)


def test_a_cursor_past_the_segment_end_loses_no_report_at_the_collector(
    tmp_path: Path, collector: LiveCollector, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: 0 of 20 reports arrived, and close() told of -999965088 bytes pending."""
    spool = tmp_path / "spool"
    first, model = attach(spool, run="cursor")
    train(first, model, 5)
    finish(first)
    DAMAGE["cursor-past-the-segment-end"](rank_dir(spool, "cursor"))
    collector.start()
    caplog.set_level(logging.WARNING)
    caplog.clear()  # the offline first run's close told of its undelivered reports
    a, model = attach(spool, run="cursor", url=collector.url)
    train(a, model, 25, start=5)
    a.close(timeout=60)
    assert_exactly_once(points(collector, "cursor"), range(25))
    assert not warnings_with(caplog, "bytes of reports not delivered")
