"""The trainer with the agent against a real collector: runs end with the right status, and an
operator's override above the trainer's lambda_max reaches it clipped while the others apply.

The debug_cpu recipe, shortened with ``train.steps``. A mid-training failure and a collector
outage are injected through the loop's ``maybe_intervene`` step (the trainer runs in this
process); the preemption is a real SIGTERM to a real ``python -m qkwatch.trainer``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qkwatch.trainer.cli import resolve_config
from qkwatch.trainer.run import train as trainer_train
from tests.live import ROOT, LiveCollector

pytestmark = pytest.mark.slow

N_LAYERS = 4  # debug_cpu
PROJECT = "e2e-status"


@pytest.fixture
def agent_env(tmp_path: Path, collector: LiveCollector, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The agent's settings, in this process's environment and for a subprocess."""
    env = {
        "QKWATCH_URL": collector.url,
        "QKWATCH_PROJECT": PROJECT,
        "QKWATCH_SPOOL": str(tmp_path / "spool"),
        "QKWATCH_RUN": "status",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **env}


def run_of(collector: LiveCollector, name: str = "status") -> dict:
    with collector.client() as c:
        (run,) = c.runs(project=PROJECT, name=name)["data"]
    return run


def train_here(tmp_path: Path, steps: int, **kwargs) -> trainer_train.TrainResult:
    cfg = resolve_config("debug_cpu", [f"train.steps={steps}"])
    return trainer_train.run(cfg, tmp_path / "out", **kwargs)


def fail_after(steps_done: int, action):
    """A ``maybe_intervene`` that does ``action()`` once ``steps_done`` steps are done."""

    def maybe_intervene(r, done: int) -> None:
        if done == steps_done:
            action()

    return maybe_intervene


def train_command(out: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qkwatch.trainer",
        "--recipe",
        "debug_cpu",
        "--set",
        f"train.steps={steps}",
        "--out",
        str(out),
    ]


def test_a_debug_cpu_run_ends_finished(tmp_path: Path, collector: LiveCollector, agent_env: dict) -> None:
    collector.start()
    done = subprocess.run(
        train_command(tmp_path / "out", 6), cwd=ROOT, env=agent_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run = run_of(collector)
    assert run["status"] == "finished" and run["last_step"] == 5


def test_a_run_that_raises_ends_crashed_with_the_reason(
    tmp_path: Path, collector: LiveCollector, agent_env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector.start()

    def boom() -> None:
        raise RuntimeError("loss went NaN at step 3\n(a second line that is not part of the reason)")

    monkeypatch.setattr(trainer_train, "maybe_intervene", fail_after(3, boom))
    with pytest.raises(RuntimeError, match="loss went NaN"):
        train_here(tmp_path, 8)
    run = run_of(collector)
    assert run["status"] == "crashed" and run["status_reason"] == "RuntimeError: loss went NaN at step 3"


def test_sigterm_ends_the_run_crashed_as_preempted(tmp_path: Path, collector: LiveCollector, agent_env: dict) -> None:
    collector.start()
    proc = subprocess.Popen(
        train_command(tmp_path / "out", 500), cwd=ROOT, env=agent_env, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stderr:
            if " step 0/500 " in line:  # the loop runs, with its SIGTERM handler in place
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, rest[-4000:]
    finally:
        proc.kill()
    run = run_of(collector)
    assert run["status"] == "crashed", run
    assert run["status_reason"].startswith("preempted: SIGTERM at step ")
    assert run["status_reason"].endswith("checkpointed; continue with --resume")
    steps = int(run["status_reason"].split(" at step ")[1].split(",")[0])
    assert 0 < steps < 500 and (tmp_path / "out" / "checkpoints" / f"step-{steps:07d}").is_dir()


def test_stop_after_ends_the_run_crashed_with_its_reason(
    tmp_path: Path, collector: LiveCollector, agent_env: dict
) -> None:
    collector.start()
    assert train_here(tmp_path, 8, stop_after=3).steps == 3
    run = run_of(collector)
    assert run["status"] == "crashed"
    assert run["status_reason"] == "stopped: stop_after=3 at step 3, checkpointed; continue with --resume"


def test_with_the_collector_down_at_close_sync_delivers_the_status(
    tmp_path: Path, collector: LiveCollector, agent_env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector.start()
    monkeypatch.setattr(trainer_train, "maybe_intervene", fail_after(3, collector.stop))  # an outage to the end
    monkeypatch.setattr(trainer_train, "MONITOR_CLOSE_TIMEOUT_S", 0.5)
    assert train_here(tmp_path, 6).steps == 6
    collector.start()
    assert run_of(collector)["status"] == "running"  # nobody told it yet
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "sync", str(tmp_path / "spool")],
        cwd=ROOT,
        env=agent_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "0 left" in done.stdout, done.stderr
    run = run_of(collector)
    assert run["status"] == "finished" and run["last_step"] == 5


def test_an_override_above_the_trainers_lambda_max_reaches_it_clipped(
    tmp_path: Path, collector: LiveCollector, agent_env: dict
) -> None:
    lambda_max = resolve_config("debug_cpu", []).to_dict()["schedule"]["lambda_max"]
    collector.start()
    with collector.client() as c:  # the operator steers before the trainer starts, under a larger bound
        run = c.create_run(PROJECT, "status", config={"n_layers": N_LAYERS, "schedule": {"lambda_max": 1.0}})
        c.set_overrides(run["id"], {"1": 0.5, "2": 0.02})
    assert 0.02 < lambda_max < 0.5
    train_here(tmp_path, 6)
    with collector.client() as c:
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl")]
        audit = c.lambdas_audit(run["id"])["data"]
    applied = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "lambda"}
    for step in (0, 5):  # the reports: what the trainer applied
        assert applied[(step, 1)] == pytest.approx(lambda_max) and applied[(step, 2)] == pytest.approx(0.02), step
    assert {r["value"] for r in rows if r["metric"] == "lambda_source"} == {0.0}  # from the collector throughout
    assert audit[-1]["who"] == "collector: lambda_max of the run's config" and audit[-1]["new"] == lambda_max
