"""The whole loop on the CPU: the trainer with the agent attached, FSDP2 over two gloo ranks, a
real collector; an operator's overrides set before the run are what the trainer applies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live import ROOT, LiveCollector

pytestmark = pytest.mark.slow

N_LAYERS = 4  # debug_cpu


def rows_of(collector: LiveCollector, project: str, name: str) -> list[dict]:
    with collector.client() as c:
        (run,) = c.runs(project=project, name=name)["data"]
        return [json.loads(line) for line in c.export(run["id"], "jsonl")]


def test_debug_cpu_under_torchrun_reports_every_layer_and_applies_the_overrides(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    overrides = {"1": 0.05, "2": 0.02}
    with collector.client() as c:
        # debug_cpu's own schedule, so that the bound the overrides meet is the trainer's
        run = c.create_run(
            "e2e", "debug", config={"n_layers": N_LAYERS, "schedule": {"lambda_0": 1e-3, "lambda_max": 0.1}}
        )
        c.set_overrides(run["id"], overrides)
    env = {
        **os.environ,
        "QKWATCH_URL": collector.url,
        "QKWATCH_PROJECT": "e2e",
        "QKWATCH_RUN": "debug",
        "QKWATCH_SPOOL": str(tmp_path / "spool"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "qkwatch.trainer",
            "--recipe",
            "debug_cpu",
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = rows_of(collector, "e2e", "debug")
    report_steps = sorted({r["step"] for r in rows if r["metric"] == "qkai"})
    assert report_steps == list(range(0, 60, 5))  # debug_cpu: 60 steps, a report every 5
    for step in report_steps:  # every layer, from both ranks (layer % 2 == rank)
        layers = sorted(r["layer"] for r in rows if r["metric"] == "attn_entropy" and r["step"] == step)
        assert layers == list(range(N_LAYERS)), step
    applied = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "lambda"}
    for step in report_steps:
        assert applied[(step, 1)] == pytest.approx(0.05) and applied[(step, 2)] == pytest.approx(0.02), step
    sources = {r["value"] for r in rows if r["metric"] == "lambda_source"}
    assert sources == {0.0}  # every applied value came from the collector
    par = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "par"}
    assert all(par[(s, 0)] == 0.0 for s in report_steps)  # layer 0: lambda 0 before evidence... and not flagged
    loss = sorted(r["step"] for r in rows if r["metric"] == "loss")
    assert loss == list(range(60))  # the trainer logs its loss at every step, and every one is stored
