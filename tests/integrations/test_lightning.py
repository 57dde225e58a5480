"""The Lightning integration against the real library and a real collector: a tiny LightningModule
trained with ``QKWatchCallback`` reads back finished, with every layer at the cadence, every scalar
Lightning logged at its step (training, lr, validation), crashed with the reason when the fit
raises, one run from two DDP processes, and the example runs as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest

from qkwatch.contract.values import clean_metric_name as metric_name
from qkwatch.integrations.lightning import QKWatchCallback
from tests.integrations.lightning_tiny import TinyLM, loader, trainer
from tests.live import ROOT, LiveCollector

FAST = {"flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}
STEPS, ACCUMULATE, EVERY = 24, 2, 4


class StepSpy(L.Callback):
    """Records every step the agent is given (it runs after QKWatchCallback, so the agent exists)."""

    def __init__(self, qk: QKWatchCallback):
        self.qk = qk
        self.steps: list[int] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        agent = self.qk.agent
        step = agent.step

        def recorded(n: int) -> None:
            self.steps.append(n)
            step(n)

        agent.step = recorded


def run_of(collector: LiveCollector, name: str) -> dict:
    with collector.client() as c:
        (run,) = c.runs(project="tests", name=name)["data"]
    return run


def steps_of(collector: LiveCollector, name: str, metric: str, layer: int = -1) -> list[int]:
    with collector.client() as c:
        return list(c.series(f"tests/{name}", metric, layer=layer).steps)


def test_a_fit_stores_every_layer_at_the_cadence_and_every_logged_scalar_at_its_step(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    qk = QKWatchCallback(
        project="tests", run="fit", every=EVERY, module="net", url=collector.url, spool=str(tmp_path / "s"), **FAST
    )
    spy = StepSpy(qk)
    lr = L.callbacks.LearningRateMonitor(logging_interval="step")
    fit = trainer(
        str(tmp_path), STEPS, [qk, spy, lr], accumulate_grad_batches=ACCUMULATE, val_check_interval=12, logger=False
    )
    fit.fit(TinyLM(), loader(4 * ACCUMULATE * STEPS), loader(8, seed=1))

    assert spy.steps == list(range(STEPS))  # once per optimizer step, never per micro-batch
    run = run_of(collector, "fit")
    assert run["status"] == "finished"
    assert run["config"]["hparams"] == {"n_layer": 2, "lr": 3e-3, "fail_at": None}
    reports = list(range(0, STEPS, EVERY))
    for layer in (0, 1):
        assert steps_of(collector, "fit", "qkai", layer) == reports
        assert steps_of(collector, "fit", "attn_entropy", layer) == reports
    assert steps_of(collector, "fit", "train_loss_step") == list(range(STEPS))  # 24 values, one a step
    assert steps_of(collector, "fit", "lr-AdamW") == list(range(STEPS))
    with collector.client() as c:
        lrs = c.series("tests/fit", "lr-AdamW").values
    assert lrs == pytest.approx([3e-3 / (1 + s) for s in range(STEPS)])
    # validation every 12 micro-batches = 6 optimizer steps, stored at the step it follows
    assert steps_of(collector, "fit", "val_loss") == [5, 11, 17, 23]
    assert steps_of(collector, "fit", "val_top-1_acc") == [5, 11, 17, 23]
    assert steps_of(collector, "fit", "train_loss_epoch") == [STEPS - 1]  # the epoch's end: at its last step
    # the logger stands in for "no logger": checkpoints and log_dir where Lightning puts them without one
    assert fit.log_dir == str(tmp_path)
    assert len(list((tmp_path / "checkpoints").glob("*.ckpt"))) == 1


def test_tags_and_notes_given_to_the_callback_reach_the_run(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    qk = QKWatchCallback(
        project="tests",
        run="tagged",
        every=EVERY,
        url=collector.url,
        spool=str(tmp_path / "s"),
        tags="lightning,tiny",  # as QKWATCH_TAGS would give them
        notes="a TinyLM, 4 steps",
        **FAST,
    )
    fit = trainer(str(tmp_path), 4, [qk], logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    fit.fit(TinyLM(), loader(16))
    run = run_of(collector, "tagged")
    assert (run["tags"], run["notes"], run["status"]) == (["lightning", "tiny"], "a TinyLM, 4 steps", "finished")


def test_an_exception_mid_fit_marks_the_run_crashed_with_the_reason(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    qk = QKWatchCallback(project="tests", run="boom", every=EVERY, url=collector.url, spool=str(tmp_path / "s"), **FAST)
    fit = trainer(str(tmp_path), STEPS, [qk], logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="loss is nan"):
        fit.fit(TinyLM(fail_at=7), loader(4 * STEPS))
    run = run_of(collector, "boom")
    assert run["status"] == "crashed" and run["status_reason"] == "RuntimeError: loss is nan"
    assert steps_of(collector, "boom", "qkai", 1) == [0, 4]  # what came before the crash is kept
    assert steps_of(collector, "boom", "train_loss_step") == list(range(7))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])  # a relaunched script; the callback pickled into spawns
def test_two_ddp_processes_on_the_cpu_make_one_run_with_every_layer(
    strategy: str, tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    steps = 8
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integrations.lightning_tiny",
            collector.url,
            str(tmp_path / "s"),
            str(tmp_path),
            str(steps),
            strategy,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run = run_of(collector, "ddp")
    assert run["status"] == "finished"
    with collector.client() as c:
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl")]
    for step in range(0, steps, 2):  # layer 0 from rank 0, layer 1 from rank 1: every layer, once
        assert sorted(r["layer"] for r in rows if r["step"] == step and r["metric"] == "qkai") == [0, 1]
    ranks = {r["metric"] for r in rows if r["metric"].startswith("agent_sent_total")}
    assert ranks == {"agent_sent_total_rank0", "agent_sent_total_rank1"}  # both processes report into it
    assert sorted(r["step"] for r in rows if r["metric"] == "train_loss_step") == list(range(steps))  # rank 0's only
    assert sorted(r["step"] for r in rows if r["metric"] == "lr-AdamW") == list(range(steps))


def test_the_example_runs_as_written(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QKWATCH_URL": collector.url, "QKWATCH_RUN": "example"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_module.py"), "--steps", "10", "--every", "5"],
        cwd=tmp_path,  # the spool and Lightning's files go here
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with collector.client() as c:
        (run,) = c.runs(project="examples", name="example")["data"]
        loss = c.series("examples/example", "train_loss_step")
        qkai = c.series("examples/example", "qkai", layer=0)
    assert run["status"] == "finished"
    assert list(loss.steps) == list(range(10)) and list(qkai.steps) == [0, 5]


def test_without_lightning_the_import_says_which_extra_to_install() -> None:
    code = "import sys; sys.modules['lightning'] = None; import qkwatch.integrations.lightning"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "ImportError: qkwatch.integrations.lightning needs PyTorch Lightning" in done.stderr
    assert "pip install 'qkwatch[lightning]'" in done.stderr


def test_metric_names_outside_the_collectors_alphabet_are_renamed() -> None:
    assert metric_name("val/loss") == "val/loss"
    assert metric_name("lr-AdamW/pg1") == "lr-AdamW/pg1"
    assert metric_name("val top-1 acc") == "val_top-1_acc"
    assert metric_name("1st (ema)") == "_1st__ema_"
    assert metric_name("x" * 200) == "x" * 128
