"""The sinks' worker: a failing sink is warned about once and never stops the others; a sink that
never returns blocks neither the step nor close; a full queue drops and counts; heatmaps come at
their cadence; the settings resolve as the agent's others do."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.config import AgentConfig
from qkwatch.agent.shipping.disk_spool import SpoolConfig
from qkwatch.agent.sinks import resolve
from qkwatch.agent.sinks.base import RunInfo
from qkwatch.agent.sinks.config import SinkConfig
from qkwatch.agent.sinks.tensorboard_sink import TensorBoardSink
from qkwatch.agent.sinks.worker import SinkWorker
from tests.agent.sinks.recording import Blocker, Boom, Recorder, wire
from tests.agent.tiny import TinyGPT, train

FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}
RUN = RunInfo(project="tests", run="w", n_layers=4)


def spooled(spool: Path) -> list[dict[str, Any]]:
    """Every report the agent spooled, in spool order."""
    (rank,) = spool.glob("*/*/rank-0")
    s = SpoolConfig().open(rank)
    try:
        return [r.payload["report"] for r in s.pending(100_000) if "report" in r.payload]
    finally:
        s.close()


def sink_warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_failing_sink_is_warned_about_once_and_the_other_gets_every_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    boom, rec = Boom(), Recorder()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(
        model, url=None, project="tests", run="boom", spool=str(tmp_path), every=2, sinks=[boom, rec], **FAST
    )
    train(a, model, 9)
    a.close(timeout=10)
    reports = spooled(tmp_path)
    assert [r.step for r in rec.reports] == [r["step"] for r in reports] and len(reports) == 9
    for got, sent in zip(rec.reports, reports, strict=True):
        assert got.scalars["loss"] == sent["scalars"]["loss"]
        assert got.layers.get("qkai", {}) == {i: v for i, v in enumerate(sent["layers"].get("qkai", []))}
    assert boom.calls == 1 + len(reports)  # opened once, then called with every report all the same
    assert rec.closed == 1 and boom.closed == 1
    (warning,) = sink_warnings(caplog, "sink 'boom'")
    assert "open()" in warning and "cannot open" in warning
    assert a.sinks is not None and a.sinks.failures == {"boom": 1 + len(reports)}


def test_a_sink_that_never_returns_blocks_neither_the_step_nor_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = Blocker()
    model = TinyGPT()
    a = agent.attach(
        model,
        url=None,
        project="tests",
        run="stuck",
        spool=str(tmp_path),
        every=1,
        sinks=[blocker],
        sink_queue=4,
        **FAST,
    )
    try:
        train(a, model, 12)  # a step that waited on the sink would hang here (pytest-timeout fails it)
        a.close(timeout=0.2)
        worker = a.sinks
        assert worker is not None and blocker.entered.is_set()
        assert sink_warnings(caplog, "the sinks had not finished when close()'s timeout ran out")
        reports = spooled(tmp_path)
        assert len(reports) == 12  # the spool kept every report the sinks could not take
        assert worker.dropped == len(reports) - 1 - 4  # one in the sink's hands, four waiting
    finally:
        blocker.release.set()
    worker._thread.join(10)
    assert not worker._thread.is_alive() and blocker.closed == 1
    assert len(blocker.reports) == 5


def test_a_full_queue_drops_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    blocker = Blocker()
    worker = SinkWorker([blocker], RUN, queue_size=3)
    assert worker.offer(wire(0, [0.1] * 4))
    assert blocker.entered.wait(10)  # the worker holds report 0 in the sink
    taken = [worker.offer(wire(s, [0.1] * 4)) for s in range(1, 9)]
    assert taken == [True] * 3 + [False] * 5 and worker.dropped == 5 and worker.pending == 3
    assert len(sink_warnings(caplog, "the sinks fall behind")) == 1
    blocker.release.set()
    assert worker.close(10)
    assert [r.step for r in blocker.reports] == [0, 1, 2, 3]
    assert not worker.offer(wire(9, [0.1] * 4))  # closed: nothing more is taken


def test_heatmaps_come_every_n_reports_with_layers_and_once_more_at_close() -> None:
    rec = Recorder()
    worker = SinkWorker([rec], RUN, heatmap_every=3)
    sent = [wire(s, [0.1 * s, None, 0.5, "nan"], loss=1.0) for s in range(7)] + [wire(7, loss=0.5)]
    before = copy.deepcopy(sent)
    for report in sent:
        assert worker.offer(report)
    assert worker.close(10)
    assert sent == before  # read, never changed
    assert [(m, step) for m, _, _, step in rec.heatmaps] == [("qkai", 2), ("qkai", 5), ("qkai", 6)]
    _, steps, layers, _ = rec.heatmaps[-1]
    assert steps == list(range(7))
    assert layers[0] == pytest.approx([0.1 * s for s in range(7)])
    assert layers[1] == [None] * 7 and layers[3] == [None] * 7  # not measured, not finite: a gap
    assert [r.step for r in rec.reports] == list(range(8)) and rec.reports[7].layers == {}


def test_heatmap_every_zero_draws_none() -> None:
    rec = Recorder()
    worker = SinkWorker([rec], RUN, heatmap_every=0)
    for s in range(5):
        worker.offer(wire(s, [0.2] * 4))
    assert worker.close(10)
    assert rec.heatmaps == [] and len(rec.reports) == 5


def test_sinks_resolve_as_the_agents_other_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SinkConfig(sinks="tensorboard, wandb").sinks == ("tensorboard", "wandb")  # type: ignore[arg-type]
    monkeypatch.setenv("QKWATCH_SINKS", "tensorboard")
    assert AgentConfig.resolve().sinking.sinks == ("tensorboard",)
    rec = Recorder()
    assert AgentConfig.resolve(sinks=[rec]).sinking.sinks == (rec,)  # the argument first
    monkeypatch.setenv("QKWATCH_SINKS", "tensorbored")
    with pytest.raises(ValueError, match=r"QKWATCH_SINKS='tensorbored': sinks: unknown sink 'tensorbored'"):
        AgentConfig.resolve()
    monkeypatch.delenv("QKWATCH_SINKS")
    with pytest.raises(ValueError, match="object is not a sink"):
        AgentConfig.resolve(sinks=[object()])
    with pytest.raises(ValueError, match="heatmap_every must be an integer >= 0"):
        AgentConfig.resolve(heatmap_every=-1)
    assert isinstance(resolve("TensorBoard"), TensorBoardSink)


def test_a_sink_whose_library_is_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # tensorboard is installed here; the one patch makes the sink's check see it absent
    from qkwatch.agent.sinks import tensorboard_sink

    monkeypatch.setattr(tensorboard_sink, "tensorboard_installed", lambda: False)
    with pytest.raises(ImportError, match=r"pip install 'qkwatch\[tensorboard\]'"):
        agent.attach(TinyGPT(), url=None, project="tests", run="missing", sinks=["tensorboard"])
    with pytest.raises(ValueError, match="unknown sink 'nope'"):
        resolve("nope")
