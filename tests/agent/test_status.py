"""How a run ended, from the agent to a real collector: finished, crashed with the reason, spooled
while the collector is away and delivered by ``qkwatch sync``, and never undone by what comes late."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from qkwatch import agent
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.test_delivery import FAST, assert_exactly_once, points
from tests.agent.tiny import TinyGPT, train
from tests.live import ROOT, LiveCollector

pytestmark = pytest.mark.slow


def run_of(collector: LiveCollector, name: str) -> dict:
    with collector.client() as c:
        (run,) = c.runs(project="tests", name=name)["data"]
    return run


def attach(model: TinyGPT, url: str | None, spool: Path, name: str) -> agent.Agent:
    return agent.attach(model, url=url, project="tests", run=name, spool=str(spool), every=1, **FAST)


def test_a_run_that_ends_is_finished_and_one_that_raises_is_crashed_with_the_reason(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    model = TinyGPT()
    with attach(model, collector.url, tmp_path / "s", "done") as a:
        train(a, model, 2)
    run = run_of(collector, "done")
    assert run["status"] == "finished" and run["status_reason"] == "patch"
    with pytest.raises(RuntimeError, match="loss is nan"), attach(model, collector.url, tmp_path / "s", "boom") as a:
        train(a, model, 2)
        raise RuntimeError("loss is nan\nat step 2")
    run = run_of(collector, "boom")
    assert run["status"] == "crashed" and run["status_reason"] == "RuntimeError: loss is nan"


def test_the_status_follows_the_last_report_and_a_long_reason_is_cut(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    model = TinyGPT()
    a = attach(model, collector.url, tmp_path / "s", "cut")
    train(a, model, 4)
    a.close(timeout=30, status="crashed", reason="preempted: " + "x" * 300)
    run = run_of(collector, "cut")
    assert run["status"] == "crashed" and len(run["status_reason"]) == 200
    assert run["status_reason"].startswith("preempted: xxx") and run["status_reason"].endswith("...")
    assert_exactly_once(points(collector, "cut"), range(4))  # every report, the last one included


def test_with_the_collector_down_at_close_the_status_waits_in_the_spool_for_sync(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    model = TinyGPT()
    a = attach(model, collector.url, tmp_path / "s", "later")
    train(a, model, 3)
    collector.stop()
    train(a, model, 6, start=3)
    a.close(timeout=0.5)
    spool = Spool(a.spool_path)
    assert spool.pending(100)[-1].payload["status"] == {"status": "finished"}  # after the last report
    spool.close()
    collector.start()
    assert run_of(collector, "later")["status"] == "running"
    for _ in range(2):  # exactly once in effect, however often sync runs
        done = subprocess.run(
            [sys.executable, "-m", "qkwatch.cli", "sync", str(tmp_path / "s")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "0 left" in done.stdout, done.stderr
        run = run_of(collector, "later")
        assert run["status"] == "finished" and run["status_reason"] == "patch"
    assert_exactly_once(points(collector, "later"), range(6))


def test_a_crash_still_spooled_does_not_end_the_attempt_that_resumes(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    model = TinyGPT()
    first = attach(model, collector.url, tmp_path / "s", "resumed")
    train(first, model, 2)
    collector.stop()  # an outage: the crash of attempt 1 stays in the spool
    train(first, model, 3, start=2)
    first.close(timeout=0.2, status="crashed", reason="preempted: SIGTERM at step 3")
    collector.start()
    second = attach(model, collector.url, tmp_path / "s", "resumed")  # attempt 2, on the same spool
    train(second, model, 6, start=3)  # its sender delivers attempt 1's reports and status first
    deadline = time.monotonic() + 30
    while second.spool.bytes_pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run_of(collector, "resumed")["status"] == "running"  # attempt 1's crash came late: ignored
    second.close(timeout=30)
    run = run_of(collector, "resumed")
    assert run["status"] == "finished" and run["latest_attempt"] == 2
    assert_exactly_once(points(collector, "resumed", attempt=1), range(3), attempt=1)


def test_who_says_what(tmp_path: Path) -> None:
    """Rank 0 says finished; any rank says crashed; None says nothing; an unknown status is refused."""

    def spooled(rank: int, **close) -> list[dict]:
        a = attach(TinyGPT(), None, tmp_path / uuid.uuid4().hex, "who")
        with pytest.raises(ValueError, match="status must be one of"):
            a.close(status="done")
        a.rank = rank  # (as on that rank)
        a.close(timeout=0.1, **close)
        spool = Spool(a.spool_path)
        statuses = [r.payload["status"] for r in spool.pending(100) if "status" in r.payload]
        spool.close()
        return statuses

    assert spooled(0) == [{"status": "finished"}]
    assert spooled(0, status=None) == []
    assert spooled(1) == []
    assert spooled(1, status="crashed", reason="  OSError: disk full ") == [
        {"status": "crashed", "reason": "OSError: disk full"}
    ]


def test_on_a_gpu_the_status_is_spooled_after_the_report_still_on_its_way(tmp_path: Path) -> None:
    """The host-copy thread (CUDA only) writes reports once their copy lands; the status queues behind them.

    Run on the CPU with a slow stand-in for the CUDA event (no GPU here).
    """
    import torch

    from qkwatch.agent.host_copy import HostCopyWriter
    from qkwatch.agent.report import Packed

    class SlowCopy:
        def synchronize(self) -> None:
            time.sleep(0.3)

    a = attach(TinyGPT(), None, tmp_path / "s", "gpu")
    a._host_copy = HostCopyWriter(a._write_report, a._append_status)
    assert a._host_copy.put(Packed(7, 1.0, [], torch.zeros(0), {}, [], SlowCopy()))
    a.close(timeout=2.0, status="crashed", reason="RuntimeError: CUDA error")
    spool = Spool(a.spool_path)
    *_, last_report, status = [r.payload for r in spool.pending(100)]
    spool.close()
    assert last_report["report"]["step"] == 7
    assert status["status"] == {"status": "crashed", "reason": "RuntimeError: CUDA error"}


def test_a_full_host_copy_queue_drops_and_counts_and_never_blocks_the_step(tmp_path: Path, monkeypatch) -> None:
    """The host-copy queue is bounded: a report that finds it full is dropped at once and counted with
    the spool's drops (``agent_dropped_total``, a ``dropped`` event); every report is kept or counted.

    Run on the CPU with a stand-in for the CUDA copy that lands only when released (no GPU here).
    """
    import threading

    import qkwatch.agent.delivery as delivery
    from qkwatch.agent.host_copy import HostCopyWriter

    release = threading.Event()

    class StuckCopy:
        def synchronize(self) -> None:
            release.wait(30)

    monkeypatch.setattr(delivery, "start_host_copy", lambda values: (values, StuckCopy()))
    model = TinyGPT()
    a = attach(model, None, tmp_path / "s", "full")
    a._host_copy = HostCopyWriter(a._write_report, a._append_status, maxsize=2)
    start = time.monotonic()
    train(a, model, 6)  # reports of steps 0-4 meet a host-copy writer stuck on the first copy
    assert time.monotonic() - start < 10  # no step waited for the copy (it would have waited 30 s)
    release.set()
    while not a._host_copy.queue.empty():
        time.sleep(0.01)
    a.close(timeout=5.0)  # step 5's report, then the status
    spool = Spool(a.spool_path)
    reports = [r.payload["report"] for r in spool.pending(100) if "report" in r.payload]
    spool.close()
    dropped = reports[-1]["scalars"]["agent_dropped_total"]
    assert dropped >= 1 and len(reports) + dropped == 6
    assert [e["data"]["count"] for r in reports for e in r.get("events", []) if e["kind"] == "dropped"] == [dropped]
