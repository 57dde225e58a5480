"""TensorBoard, read back with its own EventAccumulator: every layer's QKAI at every report step is
what the collector stores for the same run; one custom-scalars chart per metric with every layer;
the heatmaps at their cadence; and, with no collector, every report the spool keeps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.sinks.base import RunInfo, SinkAlert, SinkReport
from qkwatch.agent.sinks.tensorboard_sink import TensorBoardSink
from qkwatch.contract.colour_scale import GAP, colour_at
from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
from tests.agent.sinks.tensorboard_files import events, image, layout, scalars
from tests.agent.sinks.test_worker import FAST, spooled
from tests.agent.tiny import TinyGPT, train
from tests.live import LiveCollector

LAYERS = [f"layer_{i:02d}" for i in range(4)]


def test_every_layers_qkai_at_every_step_is_what_the_collector_stores(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    torch.manual_seed(0)
    model = TinyGPT()
    tb = TensorBoardSink(tmp_path / "tb")
    a = agent.attach(
        model, url=collector.url, project="tests", run="tb", spool=str(tmp_path / "spool"), every=2,
        sinks=[tb], heatmap_every=2, **FAST,
    )  # fmt: skip
    train(a, model, 10)
    a.close(timeout=60)
    with collector.client() as c:
        history = c.history("tests/tb", metrics=["qkai", "loss"], frame=False)
    stored: dict[tuple[int, int], float] = {}
    for step, layer, qkai in zip(history["step"], history["layer"], history["qkai"], strict=True):
        if qkai is not None:
            stored[(step, layer)] = qkai
    loss = {s: v for s, layer, v in zip(history["step"], history["layer"], history["loss"], strict=True) if layer == -1}
    acc = events(tmp_path / "tb")
    assert {s for s, _ in stored} == {0, 2, 4, 6, 8}
    for layer in range(4):
        written = scalars(acc, f"qkwatch/qkai/layer_{layer:02d}")
        # float32 on both sides of the round trip: the agent measures in float32, TensorBoard stores float32
        assert written == {s: v for (s, i), v in stored.items() if i == layer}
    assert scalars(acc, "qkwatch/loss") == loss and sorted(loss) == list(range(10))

    charts = layout(acc)["qkwatch"]
    assert charts["QKAI (qkai)"] == ["qkwatch/qkai/layer_.*"]
    first = ["QKAI (qkai)", "Stable rank of Wq Wk^T (stable_rank)", "Attention entropy (attn_entropy)"]
    assert list(charts)[:4] == [*first, "Largest attention logit (logit_max)"]  # the primary metrics first
    charted = {tags[0].split("/")[1] for tags in charts.values()}
    measured = {t.split("/")[1] for t in acc.Tags()["scalars"] if t.count("/") == 2}
    assert charted == measured and len(charted) > 10

    # every 2nd report (steps 0 2 4 6 8): at 2 and 6, and at close for step 8
    assert [e.step for e in acc.Images("qkwatch/heatmap/qkai")] == [2, 6, 8]
    step, pixels = image(acc, "qkwatch/heatmap/qkai")
    height, width, _ = pixels.shape
    assert (height % 4, width % 5) == (0, 0)  # 4 layers x 5 steps, each cell a block of pixels
    top_left = "#" + "".join(f"{c:02x}" for c in pixels[0, 0])
    assert top_left == colour_at(stored[(0, 0)], 0.0, 1.0, COLLAPSE_THRESHOLD)
    bottom_right = "#" + "".join(f"{c:02x}" for c in pixels[-1, -1])
    assert bottom_right == colour_at(stored[(8, 3)], 0.0, 1.0, COLLAPSE_THRESHOLD)


def test_with_no_collector_every_report_reaches_the_sink_and_nothing_nags(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    torch.manual_seed(1)
    model = TinyGPT()
    spool = tmp_path / "spool"
    a = agent.attach(
        model,
        url=None,
        project="tests",
        run="free",
        spool=str(spool),
        every=3,
        sinks=[TensorBoardSink(tmp_path / "tb")],
        **FAST,
    )
    train(a, model, 10)
    a.close(timeout=10)
    reports = spooled(spool)  # the spool still keeps them all, for a later `qkwatch sync`
    acc = events(tmp_path / "tb")
    assert scalars(acc, "qkwatch/loss") == {r["step"]: r["scalars"]["loss"] for r in reports}
    for layer in range(4):
        assert scalars(acc, f"qkwatch/qkai/layer_{layer:02d}") == {
            r["step"]: r["layers"]["qkai"][layer] for r in reports if r["layers"]
        }
    assert [r["step"] for r in reports if r["layers"]] == [0, 3, 6, 9]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    assert any("stay in" in r.getMessage() for r in caplog.records)  # where the spool is, said at info


def test_a_writer_of_your_own_is_flushed_not_closed_and_ranks_name_their_pictures(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer=writer)
    sink.open(RunInfo("tests", "mine", n_layers=2, rank=1, world=2))
    sink.write(SinkReport(step=4, time=1e9, layers={"qkai": {1: 0.75}}, scalars={"agent_sent_total_rank1": 3.0}))
    sink.heatmap("qkai", [4], [[None], [0.75]], 4)
    sink.alert(SinkAlert("qkai_high", True, 4, "qkwatch qkai_high firing: qkai on layer 1", "layer 1: qkai > 0.70"))
    sink.close()
    writer.add_scalar("after", 1.0, 5)  # still open: it is the caller's
    writer.close()
    acc = events(tmp_path)
    assert scalars(acc, "qkwatch/qkai/layer_01") == {4: pytest.approx(0.75)}
    assert scalars(acc, "after") == {5: 1.0}
    step, pixels = image(acc, "qkwatch/heatmap/qkai_rank1")
    assert step == 4 and "#" + "".join(f"{c:02x}" for c in pixels[0, 0]) == GAP  # layer 0 is rank 0's
    (text,) = acc.Tensors("qkwatch/alerts_rank1/text_summary")
    assert text.step == 4 and b"qkai_high firing" in text.tensor_proto.string_val[0]
