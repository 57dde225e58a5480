"""W&B, offline, read back from the run's own transaction log (``run-<id>.wandb``) with W&B's own
reader (``wandb leet inspect --json``): every layer's QKAI at every report step is what the collector
stores for the same run, on the optimizer's step (``qkwatch/step``, the x axis of every qkwatch name);
the heatmap and the every-layer chart at their cadence; an alert reaches ``run.alert``, the summary
and the tags of the user's own run, which the sink leaves running and whose rows it never drops.

No network and no API key: ``WANDB_MODE=offline``, every W&B directory in the test's tmp_path.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from qkwatch import agent
from qkwatch.agent.sinks.base import RunInfo, SinkReport
from qkwatch.agent.sinks.png import heatmap_rgb
from qkwatch.agent.sinks.wandb_sink import WandbSink
from tests.agent.sinks.test_worker import FAST, spooled
from tests.agent.tiny import TinyGPT, train
from tests.live import LiveCollector

wandb = pytest.importorskip("wandb")

LAYER = re.compile(r"^qkwatch/qkai/layer_(\d+)$")


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline, silent, writing only under tmp_path (runs, cache, staged artifacts, settings)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        folder = tmp_path / "wandb-home" / name.lower()
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))


def records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's transaction log, as W&B's own reader prints them."""
    (log,) = run_dir.glob("run-*.wandb")
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def of(recs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r[kind] for r in recs if r["type"] == kind]


def rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history rows (one per ``run.log`` call), in order."""
    return [h["item"] for h in of(recs, "history")]


def layer_values(recs: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(qkwatch/step, layer) -> QKAI, from every row; a (step, layer) written twice fails."""
    out: dict[tuple[int, int], float] = {}
    for row in rows(recs):
        for key, value in row.items():
            m = LAYER.match(key)
            if m:
                cell = (row["qkwatch/step"], int(m.group(1)))
                assert cell not in out, f"{cell} written twice"
                out[cell] = value
    return out


def test_every_layers_qkai_at_every_step_is_what_the_collector_stores(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    torch.manual_seed(0)
    model = TinyGPT()
    sink = WandbSink(mode="offline", dir=str(tmp_path))
    a = agent.attach(
        model, url=collector.url, project="tests", run="wb", spool=str(tmp_path / "spool"), every=2,
        sinks=[sink], heatmap_every=2, **FAST,
    )  # fmt: skip
    train(a, model, 10)
    a.close(timeout=60)
    with collector.client() as c:
        history = c.history("tests/wb", metrics=["qkai", "loss"], frame=False)
    stored = {
        (s, layer): v
        for s, layer, v in zip(history["step"], history["layer"], history["qkai"], strict=True)
        if v is not None
    }
    loss = {s: v for s, layer, v in zip(history["step"], history["layer"], history["loss"], strict=True) if layer == -1}
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    recs = records(run_dir)

    assert {s for s, _ in stored} == {0, 2, 4, 6, 8} and len(stored) == 20
    assert layer_values(recs) == stored  # the same doubles, at the optimizer's step
    logged = {r["qkwatch/step"]: r["qkwatch/loss"] for r in rows(recs) if "qkwatch/loss" in r}
    assert logged == loss and sorted(loss) == list(range(10))

    (run,) = of(recs, "run")[:1]
    assert (run["project"], run["display_name"]) == ("tests", "wb")
    metrics = of(recs, "metric")
    assert {"glob_name": "qkwatch/*", "step_metric": "qkwatch/step"}.items() <= metrics[1].items()
    assert metrics[0]["name"] == "qkwatch/step" and metrics[0]["options"]["hidden"]
    assert of(recs, "exit"), "the sink started the run, so it finishes it"
    assert not [t for t in threading.enumerate() if t.name.startswith("qkwatch-sinks")]

    # every 2nd report (steps 0 2 4 6 8): at 2 and 6, and at close for step 8
    pictures = [r for r in rows(recs) if "qkwatch/qkai/heatmap.path" in r]
    assert [r["qkwatch/step"] for r in pictures] == [2, 6, 8]
    steps = [0, 2, 4, 6, 8]
    grid: list[list[float | None]] = [[stored[(s, i)] for s in steps] for i in range(4)]
    pixels = np.asarray(Image.open(run_dir / "files" / pictures[-1]["qkwatch/qkai/heatmap.path"]).convert("RGB"))
    assert np.array_equal(pixels, heatmap_rgb("qkai", grid))  # the PNG the other sinks draw, pixel for pixel

    table_path = pictures[-1]["qkwatch/qkai/layers_table.path"]
    table = json.loads((run_dir / "files" / table_path).read_text())
    lines: dict[str, dict[int, float]] = {}
    for step, key, value in table["data"]:  # the line-series chart: every layer in one panel
        lines.setdefault(key, {})[step] = value
    assert lines == {f"layer_{i:02d}": {s: stored[(s, i)] for s in steps} for i in range(4)}


def test_the_users_run_gets_the_alert_keeps_its_rows_and_is_left_running(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = TinyGPT()
    user = wandb.init(project="mine", name="users-run", dir=str(tmp_path))
    a = agent.attach(
        model, url=None, project="tests", run="alerted", spool=str(tmp_path / "spool"), every=1,
        sinks=["wandb"], heatmap_every=0, **FAST,
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(8):
        a.step(step)
        model(torch.randint(0, 64, (2, 16))).sum().backward()
        opt.step()
        opt.zero_grad()
        a.log_layers(step, {"qkai": [0.1, 0.2, 0.9 if 2 <= step < 5 else 0.3, 0.1]})  # layer 2 above 0.70
        user.log({"mine/loss": float(step)})  # the user's own rows, W&B's own step
    a.close(timeout=30)
    user.log({"mine/after": 1.0})  # still the user's: the sink did not finish it
    user.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    recs = records(run_dir)

    firing, resolved = of(recs, "alert")
    assert firing["title"] == "qkwatch qkai_high firing: qkai on layer 2" and firing["level"] == "WARN"
    assert "layer 2: qkai > 0.7 for 3 consecutive reports" in firing["text"]
    assert resolved["title"].startswith("qkwatch qkai_high resolved") and resolved["level"] == "INFO"
    summary = {k: v for s in of(recs, "summary") for k, v in s.get("update", {}).items()}
    assert summary["qkwatch/alerts/qkai_high"].startswith("resolved at step")
    assert "qkwatch:qkai_high" in of(recs, "run")[-1]["tags"]

    reports = spooled(tmp_path / "spool")
    assert layer_values(recs) == {(r["step"], i): v for r in reports for i, v in enumerate(r["layers"]["qkai"])}
    mine = [r["mine/loss"] for r in rows(recs) if "mine/loss" in r]
    assert mine == [float(s) for s in range(8)]  # not one of the user's rows dropped
    assert any("mine/after" in r for r in rows(recs))
    assert [r["display_name"] for r in of(recs, "run")] == ["users-run"] * len(of(recs, "run"))


def test_a_table_heatmap_and_a_rank_of_several(tmp_path: Path) -> None:
    sink = WandbSink(mode="offline", dir=str(tmp_path), heatmap="table", layer_charts=False)
    layers: list[list[float | None]] = [[None, None], [0.25, 0.75]]  # layer 0 is rank 0's

    def worker() -> None:  # as the sinks' worker calls it: off the thread that made the sink
        sink.open(RunInfo("tests", "ranked", n_layers=2, rank=1, world=2))
        sink.write(SinkReport(step=3, time=1e9, layers={"qkai": {1: 0.25}}, scalars={}))
        sink.write(SinkReport(step=7, time=1e9, layers={"qkai": {1: 0.75}}, scalars={}))
        sink.heatmap("qkai", [3, 7], layers, 7)
        sink.close()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    recs = records(run_dir)
    assert of(recs, "run")[0]["display_name"] == "ranked-rank1"
    assert layer_values(recs) == {(3, 1): 0.25, (7, 1): 0.75}
    (picture,) = [r for r in rows(recs) if "qkwatch/qkai/heatmap_rank1.path" in r]
    assert picture["qkwatch/step"] == 7 and picture["qkwatch/qkai/heatmap_rank1._type"] == "table-file"
    table = json.loads((run_dir / "files" / picture["qkwatch/qkai/heatmap_rank1.path"]).read_text())
    assert table["columns"] == ["layer", "step", "qkai"] and table["data"] == [[1, 3, 0.25], [1, 7, 0.75]]
    assert not any("layers" in key for r in rows(recs) for key in r)
