"""The agent against a real collector (``qkwatch serve`` on a loopback port, SQLite): outages,
restarts, a training process killed with SIGKILL mid-outage and resumed, replays, the close bound.

"Every report exactly once" is checked on what the collector exports: each step's layer metrics
for every layer and its loss, once per (attempt, step, metric, layer).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.shipping.sync import sync
from qkwatch.agent.shipping.transport import HttpTransport
from tests.agent.tiny import TinyGPT, train
from tests.live import ROOT, BlackHole, LiveCollector, free_port

pytestmark = pytest.mark.slow

N_LAYERS = 4
FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}


def points(collector: LiveCollector, run_name: str, attempt: int | None = None) -> list[dict]:
    with collector.client() as c:
        (run,) = c.runs(project="tests", name=run_name)["data"]
        return [json.loads(line) for line in c.export(run["id"], "jsonl", attempt=attempt) if line.strip()]


def steps_of(rows: list[dict], metric: str, layer: int) -> list[int]:
    return sorted(r["step"] for r in rows if r["metric"] == metric and r["layer"] == layer and r["head"] == -1)


def assert_exactly_once(rows: list[dict], steps: range | list[int], attempt: int | None = None) -> None:
    keys = Counter((r["attempt"], r["step"], r["metric"], r["layer"], r["head"]) for r in rows)
    assert max(keys.values()) == 1
    for layer in range(N_LAYERS):
        for metric in ("qkai", "attn_entropy", "stable_rank"):
            assert steps_of(rows, metric, layer) == list(steps), (metric, layer)
    assert steps_of(rows, "loss", -1) == list(steps)
    if attempt is not None:
        assert {r["attempt"] for r in rows} == {attempt}


def test_outage_and_restart_store_every_report_once(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(
        model, url=collector.url, project="tests", run="outage", spool=str(tmp_path / "spool"), every=1, **FAST
    )
    train(a, model, 8)
    collector.stop()  # the collector goes away for a stretch of the stream
    train(a, model, 16, start=8)
    collector.start()
    train(a, model, 24, start=16)
    a.close(timeout=60)
    assert_exactly_once(points(collector, "outage"), range(24))


def test_offline_from_the_first_step_creates_the_run_when_the_collector_appears(
    tmp_path: Path, collector: LiveCollector
) -> None:  # not started yet: its port refuses
    model = TinyGPT()
    a = agent.attach(
        model, url=collector.url, project="tests", run="late", spool=str(tmp_path / "spool"), every=1, **FAST
    )
    train(a, model, 5)
    collector.start()
    train(a, model, 10, start=5)
    a.close(timeout=60)
    assert_exactly_once(points(collector, "late"), range(10))


def test_sigkill_in_an_outage_then_resume_loses_nothing(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    spool = tmp_path / "spool"
    cmd = [
        sys.executable,
        "-m",
        "tests.agent.tiny",
        "--run",
        "killed",
        "--spool",
        str(spool),
        "--url",
        collector.url,
        "--every",
        "1",
        "--sleep",
        "0.02",
    ]
    proc = subprocess.Popen([*cmd, "--steps", "100000"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    printed = []
    for line in proc.stdout:
        printed.append(int(line.split()[1]))
        if len(printed) == 6:
            collector.stop()  # outage
        if len(printed) == 14:
            proc.kill()  # SIGKILL while the collector is down
            break
    proc.wait(timeout=30)
    last = printed[-1]
    collector.start()
    resumed = subprocess.run(
        [*cmd, "--start", str(last + 1), "--steps", str(last + 6)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = points(collector, "killed", attempt=1)
    # report s reaches the spool when step s + 1 begins: every printed step but the last is on disk
    stored = steps_of(first, "qkai", 0)
    assert stored[:last] == list(range(last))
    assert_exactly_once(first, stored, attempt=1)
    assert_exactly_once(points(collector, "killed", attempt=2), range(last + 1, last + 6), attempt=2)


def test_sync_delivers_a_spool_exactly_once_however_often_it_runs(tmp_path: Path, collector: LiveCollector) -> None:
    model = TinyGPT()
    spool = tmp_path / "spool"
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens during the run
    a = agent.attach(model, url=url, project="tests", run="synced", spool=str(spool), every=1, **FAST)
    train(a, model, 6)
    a.close(timeout=0.5)
    replay = tmp_path / "replay"
    shutil.copytree(spool, replay)  # a stale copy: replays everything again later
    collector.start()
    for source in (spool, spool, replay):
        done = subprocess.run(
            [sys.executable, "-m", "qkwatch.cli", "sync", str(source), "--collector", collector.url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "0 left" in done.stdout
    assert_exactly_once(points(collector, "synced"), range(6))


def test_sync_of_a_spool_whose_meta_names_no_run_is_one_line(tmp_path: Path) -> None:
    """A ``meta.json`` without its project or run name (damaged by hand) is one line naming the file,
    exit 2, not a KeyError's traceback (issue 42)."""
    model = TinyGPT()
    spool = tmp_path / "spool"
    url = f"http://127.0.0.1:{free_port()}"
    a = agent.attach(model, url=url, project="tests", run="nameless", spool=str(spool), every=1, **FAST)
    train(a, model, 2)
    a.close(timeout=0.5)
    (meta_path,) = spool.rglob("meta.json")
    meta = json.loads(meta_path.read_text())
    del meta["name"]
    meta_path.write_text(json.dumps(meta))
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "sync", str(spool), "--collector", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"qkwatch sync: {meta_path} names no project or run: its reports cannot be delivered"


def test_close_returns_within_its_timeout_when_the_collector_hangs(tmp_path: Path) -> None:
    """``close(1.0)`` gives up on a request the collector never answers: it returns while the sender
    is still inside that request (whose own timeout is 600 s), and the reports stay spooled.

    Events, not a stopwatch: the only time bound is a generous one that a close waiting out the
    request could not meet, so a loaded machine cannot fail it.
    """
    hole = BlackHole()  # accepts connections, never answers
    model = TinyGPT()
    a = agent.attach(
        model,
        url=hole.url,
        project="tests",
        run="hung",
        spool=str(tmp_path / "spool"),
        every=1,
        request_timeout=600.0,
        **FAST,
    )
    train(a, model, 3)
    closer = threading.Thread(target=a.close, kwargs={"timeout": 1.0}, daemon=True)
    try:
        closer.start()
        closer.join(60)
        assert not closer.is_alive()  # close returned...
        assert a.sender._thread.is_alive() and hole.held  # ...while the sender still waits on the hung collector
        a.close(timeout=1.0)  # idempotent
    finally:
        hole.close()  # the collector hangs up: the abandoned sender thread ends
    a.sender._thread.join(120)
    assert not a.sender._thread.is_alive()
    assert a.spool_path.exists() and list(a.spool_path.glob("seg-*.log"))  # the reports stay spooled


STEERED = {"lambda_0": 0.1}
"""A schedule whose lambda_max (100 x lambda_0) admits the overrides below."""


class StoppedClock:
    """A monotonic clock that stands still until ``advance``: injected into the agent's lambdas
    (``Lambdas.clock``) so that their age is set by the test, not by how busy the machine is."""

    def __init__(self) -> None:
        self.now = time.monotonic()  # values fetched before it was injected are a moment old, not stale

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def heard_of_step_0(a, collector: LiveCollector, run_id: str, after_version: int) -> None:
    """Wait (for events, not a time) until the collector's lambdas have moved past ``after_version``
    on step 0's report and the agent's poller has taken them: polls run one after another, so the
    second one to finish after the collector moved fetched the new lambdas."""
    deadline = time.monotonic() + 60
    http = HttpTransport(collector.url, None, 10.0)
    try:
        while http.get_lambdas(run_id)["version"] <= after_version and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        http.close()
    answered = a.poller.answered
    while a.poller.answered < answered + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert time.monotonic() < deadline, "the collector's lambdas did not move, or the poller did not fetch them"


def test_operator_overrides_set_before_the_run_are_applied_from_step_zero(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    with collector.client() as c:
        run = c.create_run("tests", "steered", config={"n_layers": N_LAYERS, "schedule": STEERED})
        c.set_overrides(run["id"], {"1": 0.5, "3": 0.25})
    model = TinyGPT()
    a = agent.attach(
        model,
        url=collector.url,
        project="tests",
        run="steered",
        config={"schedule": STEERED},
        spool=str(tmp_path / "spool"),
        every=2,
        lambda_sync_every=2,
        lambda_stale_seconds=60.0,
        lambda_poll_seconds=0.1,
        **FAST,
    )
    clock = StoppedClock()  # the lambdas age only when the test says so, however slow the machine
    a.lambdas_state.clock = clock
    applied = {}
    for step in range(4):
        if step == 2:  # the next exchange: first let the collector's schedule answer step 0's report
            heard_of_step_0(a, collector, run["id"], after_version=a.lambdas_state.version)  # step 0's version
            expected = list(a.lambdas_state.local_values())  # the schedule, from the same report
        a.step(step)
        applied[step] = a.lambdas()
        model(torch.randint(0, 64, (2, 32)))
    assert applied[0] == applied[1] == [0.0, 0.5, 0.0, 0.25]  # no entropy known yet: the overrides alone
    assert applied[2] == applied[3] == pytest.approx([expected[0], 0.5, expected[2], 0.25], rel=1e-6)
    assert min(expected) > 0.05  # near-uniform attention: the schedule penalises the other layers
    assert a.lambdas_state.source == "collector"
    collector.stop()
    failed = a.poller.failed
    deadline = time.monotonic() + 60
    while a.poller.failed == failed and time.monotonic() < deadline:  # a poll after the stop got no answer:
        time.sleep(0.02)  # every answer fetched before it has been offered (the poller works in order)
    assert a.poller.failed > failed
    clock.advance(61.0)  # past lambda_stale_seconds without an answer
    a.step(4)
    local = a.lambdas()
    assert a.lambdas_state.source == "local"
    assert local == list(a.lambdas_state.local_values()) and min(local) > 0.05  # near-uniform attention: penalised
    a.close(timeout=0.5)
    collector.start()
    sync(a.spool_path)  # what the outage kept in the spool
    rows = points(collector, "steered")
    lam = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "lambda"}
    assert [lam[(2, layer)] for layer in range(N_LAYERS)] == pytest.approx(applied[2], rel=1e-6)  # as applied
    source = {r["step"]: r["value"] for r in rows if r["metric"] == "lambda_source"}
    assert source[0] == 0.0 and source[4] == 1.0  # 0 = collector, 1 = local


def test_what_the_spool_caps_drop_is_counted_and_reaches_the_collector(
    tmp_path: Path, collector: LiveCollector
) -> None:
    model = TinyGPT()
    a = agent.attach(
        model,
        url=collector.url,
        project="tests",
        run="capped",
        spool=str(tmp_path / "spool"),
        every=1,
        segment_bytes=4096,
        spool_max_bytes=12_000,
        **FAST,
    )
    train(a, model, 30)  # the collector is down: the spool overflows its cap
    collector.start()
    train(a, model, 33, start=30)
    a.close(timeout=60)
    rows = points(collector, "capped")
    dropped = max(r["value"] for r in rows if r["metric"] == "agent_dropped_total")  # a running total
    kept = steps_of(rows, "qkai", 0)
    assert dropped > 0 and len(kept) + dropped == 33  # every report is either stored or counted
    assert kept == sorted(kept) and kept[-3:] == [30, 31, 32]  # the oldest went first
    with collector.client() as c:
        (run,) = c.runs(project="tests", name="capped")["data"]
        events = c.events(run["id"], kind="dropped")["data"]
    assert events  # (events riding on reports that were dropped later are gone with them)
    depth = max(r["value"] for r in rows if r["metric"] == "agent_queue_depth")
    assert depth > 0  # the agent's own health travels with the reports (here: the backlog of the outage)


def test_shuffled_and_repeated_deliveries_store_each_report_once(tmp_path: Path, collector: LiveCollector) -> None:
    """A spool's reports delivered out of order, in random batches, several times over."""
    import random

    from qkwatch.agent.shipping.disk_spool import Spool

    model = TinyGPT()
    a = agent.attach(
        model, url=None, project="tests", run="shuffled", spool=str(tmp_path / "spool"), every=1, spectra_every=0
    )
    train(a, model, 12)
    a.close(timeout=0.1)
    spool = Spool(a.spool_path)
    records = [r.payload for r in spool.pending(1000)]
    spool.close()
    assert records[-1]["status"] == {"status": "finished"}  # how the run ended comes last
    reports = [r["report"] for r in records[:-1]]
    collector.start()
    rng = random.Random(0)
    with collector.client() as c:
        run = c.create_run("tests", "shuffled")
        for _ in range(3):
            order = reports[:]
            rng.shuffle(order)
            while order:
                size = rng.randint(1, 5)
                c.send_reports(run["id"], order[:size])  # a fresh batch id each time: only the natural key dedups
                order = order[size:]
    assert_exactly_once(points(collector, "shuffled"), range(12))
