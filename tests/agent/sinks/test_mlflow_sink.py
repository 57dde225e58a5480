"""MLflow, a local file store read back with ``MlflowClient``: every layer's QKAI at every report
step is what the collector stores for the same run, at the optimizer's step; the heatmap as
MLflow's time-stepped image; a second MLflow sink whose tracking server is a closed loopback port
is warned about once and neither training, the collector nor the working sink miss anything; the
user's active run (made on the training thread, logged to from the worker thread) gets the alert as
a tag and is left running.

The store is MLflow's file store (``file:`` URI in tmp_path, with ``MLFLOW_ALLOW_FILE_STORE=true``:
MLflow 3 refuses it otherwise, in favour of a database that takes seconds to migrate).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from qkwatch import agent
from qkwatch.agent.sinks.base import RunInfo
from qkwatch.agent.sinks.mlflow_sink import MlflowSink
from qkwatch.agent.sinks.png import heatmap_png, heatmap_rgb
from tests.agent.sinks.test_worker import FAST, sink_warnings, spooled
from tests.agent.tiny import TinyGPT, train
from tests.live import LiveCollector, free_port

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file store in tmp_path, MLflow's tracking URI while the test runs; a failing request fails at once."""
    uri = (tmp_path / "mlruns").as_uri()
    for name, value in {
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    }.items():
        monkeypatch.setenv(name, value)
    return uri


def history(client: Any, run_id: str, key: str) -> dict[int, float]:
    points = client.get_metric_history(run_id, key)
    assert len({m.step for m in points}) == len(points), f"{key}: a step logged twice"
    return {m.step: m.value for m in points}


def images(client: Any, run_id: str, key: str) -> dict[int, np.ndarray]:
    """MLflow's time-stepped images of ``key`` by step (the full-size PNGs)."""
    folder = Path(client.download_artifacts(run_id, "images"))
    prefix = key.replace("/", "~") + "+step+"
    out = {}
    for path in folder.glob(f"{prefix}*.png"):
        out[int(path.name[len(prefix) :].split("+")[0])] = np.asarray(Image.open(path).convert("RGB"))
    return out


def test_every_layers_qkai_at_every_step_is_what_the_collector_stores(
    tmp_path: Path, collector: LiveCollector, store: str, caplog: pytest.LogCaptureFixture
) -> None:
    collector.start()
    torch.manual_seed(0)
    model = TinyGPT()
    down = MlflowSink(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    sink = MlflowSink()
    a = agent.attach(
        model, url=collector.url, project="tests", run="ml", spool=str(tmp_path / "spool"), every=2,
        sinks=[down, sink], heatmap_every=2, **FAST,
    )  # fmt: skip
    train(a, model, 10)
    a.close(timeout=60)
    with collector.client() as c:
        stored_history = c.history("tests/ml", metrics=["qkai", "loss"], frame=False)
    rows = zip(
        stored_history["step"], stored_history["layer"], stored_history["qkai"], stored_history["loss"], strict=True
    )
    stored, loss = {}, {}
    for step, layer, qkai, value in rows:
        if qkai is not None:
            stored[(step, layer)] = qkai
        if layer == -1:
            loss[step] = value

    client = MlflowClient(store)
    assert sink.run_id is not None and sink.owned is False  # ended
    run = client.get_run(sink.run_id)
    assert (run.info.run_name, run.info.status) == ("ml", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert {s for s, _ in stored} == {0, 2, 4, 6, 8} and len(stored) == 20
    for layer in range(4):
        assert history(client, sink.run_id, f"qkwatch/qkai/layer_{layer:02d}") == {
            s: v for (s, i), v in stored.items() if i == layer
        }
    assert history(client, sink.run_id, "qkwatch/loss") == loss and sorted(loss) == list(range(10))

    pictures = images(client, sink.run_id, "qkwatch/qkai/heatmap")
    assert sorted(pictures) == [2, 6, 8]  # every 2nd report, and at close
    grid: list[list[float | None]] = [[stored[(s, i)] for s in (0, 2, 4, 6, 8)] for i in range(4)]
    assert np.array_equal(pictures[8], heatmap_rgb("qkai", grid))

    (warning,) = sink_warnings(caplog, "sink 'mlflow' failed")  # the one down: once, in open()
    assert "open()" in warning
    assert down.run_id is None
    assert not [t for t in threading.enumerate() if t.name.startswith("qkwatch-sinks")]


def test_the_active_run_gets_the_alert_as_a_tag_and_is_left_running(tmp_path: Path, store: str) -> None:
    torch.manual_seed(1)
    model = TinyGPT()
    with mlflow.start_run(run_name="users-run") as users:
        a = agent.attach(
            model, url=None, project="tests", run="alerted", spool=str(tmp_path / "spool"), every=1,
            sinks=["mlflow"], heatmap_every=0, **FAST,
        )  # fmt: skip
        for step in range(8):
            a.step(step)
            model(torch.randint(0, 64, (2, 16)))
            a.log_layers(step, {"qkai": [0.1, 0.2, 0.9 if 2 <= step < 5 else 0.3, 0.1]})  # layer 2 above 0.70
            mlflow.log_metric("mine/loss", float(step), step=step)
        a.close(timeout=30)
        run_id = users.info.run_id
        client = MlflowClient(store)
        assert client.get_run(run_id).info.status == "RUNNING"  # the user's: not ended by the sink
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["qkwatch.run"] == "alerted"
    assert run.data.tags["qkwatch.alert.qkai_high"].startswith("resolved at step")
    alerts = json.loads(Path(client.download_artifacts(run_id, "qkwatch/alerts.json")).read_text())
    assert [(x["state"], x["layers"], x["onset_step"]) for x in alerts] == [("firing", [2], 2), ("resolved", [2], 2)]
    assert alerts[0]["title"] == "qkwatch qkai_high firing: qkai on layer 2" and alerts[0]["step"] == 4

    reports = spooled(tmp_path / "spool")
    for layer in range(4):
        assert history(client, run_id, f"qkwatch/qkai/layer_{layer:02d}") == {
            r["step"]: r["layers"]["qkai"][layer] for r in reports
        }
    assert history(client, run_id, "mine/loss") == {s: float(s) for s in range(8)}


def test_without_pillow_the_heatmap_is_a_png_artifact_and_a_run_it_made_is_ended(tmp_path: Path, store: str) -> None:
    sink = MlflowSink(experiment="pictures", heatmap="artifact")
    layers: list[list[float | None]] = [[0.2, 0.8], [None, 0.5]]

    def worker() -> None:  # as the sinks' worker calls it: off the thread that made the sink
        sink.open(RunInfo("tests", "art", n_layers=2, rank=1, world=2))
        sink.heatmap("qkai", [0, 5], layers, 5)
        sink.close()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    client = MlflowClient(store)
    assert sink.run_id is not None
    run = client.get_run(sink.run_id)
    assert (run.info.run_name, run.info.status) == ("art-rank1", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "pictures"
    png = Path(client.download_artifacts(sink.run_id, "qkwatch/heatmaps/qkai_rank1.png")).read_bytes()
    assert png == heatmap_png("qkai", layers)
    described = json.loads(Path(client.download_artifacts(sink.run_id, "qkwatch/run.json")).read_text())
    assert (described["run"], described["rank"], described["world"], described["n_layers"]) == ("art", 1, 2, 2)


def test_a_run_that_is_not_there_is_warned_about_once_and_training_misses_nothing(
    tmp_path: Path, store: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    model = TinyGPT()
    sink = MlflowSink(run_id="0" * 32)  # no such run in the store
    a = agent.attach(
        model, url=None, project="tests", run="gone", spool=str(tmp_path / "spool"), every=1, sinks=[sink], **FAST
    )
    train(a, model, 4)
    a.close(timeout=30)
    (warning,) = sink_warnings(caplog, "sink 'mlflow' failed")
    assert "open()" in warning
    assert len(spooled(tmp_path / "spool")) == 4
    assert not [t for t in threading.enumerate() if t.name.startswith("qkwatch-sinks")]
