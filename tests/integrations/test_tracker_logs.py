"""qkwatch's layers in the tracker the user already set up, through the trainers' own logging.

The HF Trainer with ``report_to=["tensorboard"]`` and Lightning with a ``TensorBoardLogger`` each
train a tiny model with qkwatch's callback and a real collector; their TensorBoard event files,
read back with TensorBoard's own ``EventAccumulator``, hold qkwatch's per-layer values, equal to
what the collector stores, at the steps the integrations document (HF: the report of step ``G - 2``
in the log at ``G``, with ``qkwatch/step``; Lightning: every report at its own step). Switched off,
no qkwatch key reaches the event file, and the Trainer's console lines never carry them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from qkwatch.agent import RunInfo, SinkReport, layer_tag
from qkwatch.integrations import lightning as qk_lightning
from qkwatch.integrations.huggingface import QKWatchCallback
from qkwatch.integrations.huggingface.tracker_logs import STEP_KEY, TrackerLogs, lead
from qkwatch.integrations.latest import LatestReports, chosen_metrics, with_sink
from tests.integrations.hf_tiny import FAST, N_LAYERS, Tokens, arguments, tiny_llama
from tests.integrations.lightning_tiny import TinyLM, loader, trainer
from tests.live import LiveCollector

STEPS, EVERY = 12, 2
PRIMARY = ("qkai", "stable_rank", "attn_entropy", "logit_max", "lambda")
MEASURED = ("qkai", "stable_rank", "attn_entropy", "logit_max")
"""The primary metrics every report has (lambda comes only with RAA's weights)."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCollector]:
    """One collector for the module's runs (each run its own name): a collector starts in seconds, a run in one."""
    live = LiveCollector(tmp_path_factory.mktemp("collector"))
    try:
        live.start()
        yield live
    finally:
        live.stop()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def event_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``logdir``: tag -> step -> value (TensorBoard's own reader)."""
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def stored(collector: LiveCollector, run: str, metric: str, layer: int) -> dict[int, float]:
    with collector.client() as c:
        series = c.series(f"tests/{run}", metric, layer=layer)
    return dict(zip(series.steps, series.values, strict=True))


def stored_names(collector: LiveCollector, run: str) -> set[str]:
    """Every metric the collector holds for the run (per-layer and run-level)."""
    with collector.client() as c:
        return set(c.history(f"tests/{run}", frame=False)) - {"step", "layer"}


def as_float32(value: float) -> float:
    """What a TensorBoard scalar keeps of a value (a float32)."""
    return float(np.float32(value))


class SinksKeepUp(TrainerCallback):
    """Test-only: each step's end waits until the agent's sinks' worker has written every report offered
    to it, so each log sees the newest finished report (in a real run the worker is usually, not
    always, that quick). Counts the offers by wrapping the worker's ``offer``, as test_lightning's
    StepSpy wraps ``agent.step``."""

    def __init__(self, qk: QKWatchCallback) -> None:
        self.qk = qk
        self.offered = 0
        self._lock = threading.Lock()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        assert self.qk.agent is not None and self.qk.agent.sinks is not None
        worker = self.qk.agent.sinks
        offer = worker.offer

        def counted(report: Any) -> bool:
            accepted = offer(report)
            with self._lock:
                self.offered += int(accepted)
            return accepted

        worker.offer = counted  # type: ignore[method-assign]

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        assert self.qk.agent is not None and self.qk.agent.sinks is not None
        worker = self.qk.agent.sinks
        deadline = time.monotonic() + 30  # a guard against a hang, not a timing
        while worker.written < self.offered:
            assert time.monotonic() < deadline, f"the sinks' worker wrote {worker.written} of {self.offered}"
            time.sleep(0.002)


def hf_trainer(tmp_path: Path, qk: QKWatchCallback, *extra: TrainerCallback, **overrides: Any) -> Trainer:
    settings = {"max_steps": STEPS, "logging_steps": 1, "report_to": ["tensorboard"], **overrides}
    args = arguments(tmp_path / "out", **settings)
    return Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(64), callbacks=[qk, *extra])


def hf_watch(tmp_path: Path, run: str, url: str | None, **settings: Any) -> QKWatchCallback:
    return QKWatchCallback(
        project="tests", run=run, url=url, every=EVERY, spool=str(tmp_path / "spool"), **FAST, **settings
    )


# --- the HF Trainer ---------------------------------------------------------------------------------


def test_the_trainers_tensorboard_gets_each_report_at_the_log_two_steps_later(
    tmp_path: Path, shared: LiveCollector, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    collector = shared
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    qk = hf_watch(tmp_path, "hf-tb", collector.url)
    hf_trainer(tmp_path, qk, SinksKeepUp(qk)).train()  # disable_tqdm: PrinterCallback prints each log

    scalars = event_scalars(tmp_path / "tb")
    # the log at global step G carries the report of step G - 2, once: reports 0, 2, ..., 10 at 2, 4, ..., 12
    reports = {g: r for g, r in scalars[f"train/{STEP_KEY}"].items()}
    assert reports == {r + 2: r for r in range(0, STEPS - 1, EVERY)}
    assert {t for t in scalars if "qkwatch/" in t} == {f"train/{STEP_KEY}"} | {
        f"train/{layer_tag(m, i, N_LAYERS)}" for m in MEASURED for i in range(N_LAYERS)
    }  # lambda: no RAA here, so no report has it
    for metric in MEASURED:
        for layer in range(N_LAYERS):
            kept = stored(collector, "hf-tb", metric, layer)
            assert sorted(kept) == list(range(0, STEPS, EVERY)), (metric, layer)
            shown = scalars[f"train/{layer_tag(metric, layer, N_LAYERS)}"]
            assert shown == {g: as_float32(kept[r]) for g, r in reports.items()}, (metric, layer)
    assert len(scalars["train/loss"]) == STEPS  # the Trainer's own values are there as before
    names = stored_names(collector, "hf-tb")  # qkwatch's values did not go back into the collector as scalars
    assert {"qkai", "loss"} <= names and not [n for n in names if "qkwatch" in n]

    printed = capsys.readouterr().out
    assert printed.count("'loss'") == STEPS and "qkwatch" not in printed  # PrinterCallback: the Trainer's keys only


def test_with_the_progress_bar_and_chosen_metrics_the_console_stays_the_trainers(
    tmp_path: Path, shared: LiveCollector, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No waiting for the worker: whichever reports arrived in time, each is logged once, no newer than G - 2."""
    collector = shared
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    qk = hf_watch(tmp_path, "hf-bar", collector.url, tracker_logs=["qkai"])
    hf_trainer(tmp_path, qk, disable_tqdm=False).train()  # ProgressCallback writes each log under the bar

    scalars = event_scalars(tmp_path / "tb")
    reports = scalars[f"train/{STEP_KEY}"]
    assert reports, "no report reached the Trainer's logs"
    assert list(reports.values()) == sorted(set(reports.values()))  # each once, in order
    assert all(r % EVERY == 0 and r <= g - 2 for g, r in reports.items())
    assert {t for t in scalars if "qkwatch/" in t} == {f"train/{STEP_KEY}"} | {
        f"train/{layer_tag('qkai', i, N_LAYERS)}" for i in range(N_LAYERS)
    }
    for layer in range(N_LAYERS):
        kept = stored(collector, "hf-bar", "qkai", layer)
        shown = scalars[f"train/{layer_tag('qkai', layer, N_LAYERS)}"]
        assert shown == {g: as_float32(kept[int(r)]) for g, r in reports.items()}
    printed = capsys.readouterr().out
    assert printed.count("'loss'") == STEPS and "qkwatch" not in printed


def test_switched_off_no_qkwatch_key_reaches_the_trainers_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    qk = hf_watch(tmp_path, "hf-off", None, tracker_logs=False)
    trainer = hf_trainer(tmp_path, qk)
    before = list(trainer.callback_handler.callbacks)
    trainer.train()
    scalars = event_scalars(tmp_path / "tb")
    assert "train/loss" in scalars and not [t for t in scalars if "qkwatch" in t]
    assert trainer.callback_handler.callbacks == before  # switched off, the callbacks keep their order


def test_the_callback_leads_and_the_dropper_stands_before_the_printer(tmp_path: Path) -> None:
    qk = hf_watch(tmp_path, "hf-order", None)
    trainer = hf_trainer(tmp_path, qk, max_steps=2)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names == ["DefaultFlowCallback", "TensorBoardCallback", "QKWatchCallback", "PrinterCallback"]
    trainer.train()
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names == [
        "QKWatchCallback",
        "DefaultFlowCallback",
        "TensorBoardCallback",
        "DropLayerKeys",
        "PrinterCallback",
    ]
    trainer.train()  # again: still one of each
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks] == names


def test_lead_puts_the_dropper_last_when_nothing_prints() -> None:
    a, b, qk, drop = TrainerCallback(), TrainerCallback(), TrainerCallback(), TrainerCallback()
    assert lead([a, qk, b], qk, drop) == [qk, a, b, drop]
    assert lead([a, qk, drop, b], qk, drop) == [qk, a, b, drop]


def test_without_a_callback_handler_one_warning_and_no_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that calls the callback's events itself: the run is watched, the logs get nothing of qkwatch's."""
    qk = hf_watch(tmp_path, "hf-bare", None)
    args = arguments(tmp_path / "out")
    state, control, model = TrainerState(), TrainerControl(), tiny_llama()
    with caplog.at_level(logging.WARNING, logger="qkwatch"):
        for _ in range(2):
            qk.on_train_begin(args, state, control, model=model)
            for step in range(4):
                state.global_step = step
                qk.on_step_begin(args, state, control)
                model(input_ids=torch.zeros(1, 8, dtype=torch.long))
                logs: dict[str, Any] = {"loss": 1.0}
                qk.on_log(args, state, control, logs=logs)
                assert logs == {"loss": 1.0}
            qk.on_train_end(args, state, control)
    warned = [r for r in caplog.records if "CallbackHandler" in r.getMessage()]
    assert len(warned) == 1


def report(step: int, **layers: list[float]) -> SinkReport:
    return SinkReport(
        step=step, time=0.0, layers={m: dict(enumerate(v)) for m, v in layers.items()}, scalars={"loss": 1.0}
    )


def test_each_log_gets_the_newest_report_that_arrived_since_the_last_once() -> None:
    tracker = TrackerLogs(["qkai"])
    tracker.sink = sink = LatestReports(tracker.metrics)
    sink.open(RunInfo("tests", "unit", n_layers=2))
    sink.write(report(0, qkai=[0.1, 0.2]))
    sink.write(report(2, qkai=[0.3, 0.4], attn_entropy=[0.9, 0.9]))
    sink.write(report(3))  # scalars only (a logged step between reports): not kept
    logs: dict[str, Any] = {"loss": 2.5}
    tracker.add_to(logs)
    assert logs == {"loss": 2.5, "qkwatch/qkai/layer_00": 0.3, "qkwatch/qkai/layer_01": 0.4, STEP_KEY: 2}
    tracker.drop_from(logs)
    assert logs == {"loss": 2.5}
    again: dict[str, Any] = {"loss": 2.4}
    tracker.add_to(again)  # nothing new since: nothing added
    assert again == {"loss": 2.4}


def test_the_buffer_is_bounded_and_counts_what_it_pushed_out() -> None:
    sink = LatestReports(["qkai"], keep=2)
    sink.open(RunInfo("tests", "unit", n_layers=12))
    for step in range(5):
        sink.write(report(step, qkai=[float(step)]))
    assert sink.drain() == [(3, {"qkwatch/qkai/layer_00": 3.0}), (4, {"qkwatch/qkai/layer_00": 4.0})]
    assert sink.dropped == 3 and sink.drain() == []


def test_the_sink_joins_the_users_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = LatestReports(["qkai"])
    assert with_sink({"every": 5}, None) == {"every": 5}
    assert with_sink({"sinks": "tensorboard, wandb"}, sink)["sinks"] == ["tensorboard", "wandb", sink]
    assert with_sink({"sinks": ["mlflow"]}, sink)["sinks"] == ["mlflow", sink]
    monkeypatch.setenv("QKWATCH_SINKS", "tensorboard")  # an explicit sinks= would hide the environment's
    assert with_sink({}, sink)["sinks"] == ["tensorboard", sink]


def test_chosen_metrics() -> None:
    assert chosen_metrics(True) == PRIMARY
    assert chosen_metrics(False) == ()
    assert chosen_metrics(["qk_cos", "qkai", "qk_cos"]) == ("qk_cos", "qkai")
    with pytest.raises(ValueError, match="loss"):
        chosen_metrics(["qkai", "loss"])  # a run-level scalar, not a per-layer metric
    with pytest.raises(ValueError, match="qkia"):
        QKWatchCallback(tracker_logs=["qkia"])


# --- Lightning --------------------------------------------------------------------------------------


def pl_watch(tmp_path: Path, run: str, url: str | None, **settings: Any) -> qk_lightning.QKWatchCallback:
    return qk_lightning.QKWatchCallback(
        project="tests", run=run, every=EVERY, module="net", url=url, spool=str(tmp_path / "spool"), **FAST, **settings
    )


def test_lightnings_tensorboard_logger_gets_every_report_at_its_own_step(tmp_path: Path, shared: LiveCollector) -> None:
    collector = shared
    qk = pl_watch(tmp_path, "pl-tb", collector.url)
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    fit = trainer(str(tmp_path), STEPS, [qk], logger=tb)
    fit.fit(TinyLM(), loader(4 * STEPS))

    scalars = event_scalars(Path(tb.log_dir))
    n_layers = 2
    assert {t for t in scalars if t.startswith("qkwatch/")} == {
        layer_tag(m, i, n_layers) for m in MEASURED for i in range(n_layers)
    }
    for metric in MEASURED:
        for layer in range(n_layers):
            kept = stored(collector, "pl-tb", metric, layer)
            assert sorted(kept) == list(range(0, STEPS, EVERY)), (metric, layer)  # the last one too (on_fit_end)
            shown = scalars[layer_tag(metric, layer, n_layers)]
            assert shown == {s: as_float32(v) for s, v in kept.items()}, (metric, layer)
    assert sorted(scalars["train_loss_step"]) == list(range(STEPS))  # the module's own logging as before
    names = stored_names(collector, "pl-tb")  # the callback's own logger did not hand them back to the agent
    assert {"qkai", "train_loss_step"} <= names and not [n for n in names if "qkwatch" in n]


def test_lightning_switched_off_no_qkwatch_key_reaches_the_logger(tmp_path: Path) -> None:
    qk = pl_watch(tmp_path, "pl-off", None, tracker_logs=False)
    tb = TensorBoardLogger(str(tmp_path / "tb"))
    trainer(str(tmp_path), 4, [qk], logger=tb).fit(TinyLM(), loader(16))
    scalars = event_scalars(Path(tb.log_dir))
    assert "train_loss_step" in scalars and not [t for t in scalars if "qkwatch" in t]
    assert qk.agent is not None and qk.agent.sinks is None  # no sink was given the agent
