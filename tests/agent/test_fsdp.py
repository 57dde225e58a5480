"""The agent under FSDP2 with two gloo ranks on the CPU, one of them refused by the collector."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkwatch.agent.shipping.sync import sync
from tests.live import ROOT, LiveCollector

pytestmark = pytest.mark.slow

STEPS = 6


def test_fsdp2_two_ranks_one_refused_no_hang_values_equal_unsharded(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    out = tmp_path / "out.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "tests.agent.fsdp_agent",
            collector.url,
            str(tmp_path / "spool"),
            str(out),
            str(STEPS),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang fails here
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    with collector.client() as c:
        (run,) = c.runs(project="tests", name="fsdp")["data"]
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl")]
    layers = lambda metric: sorted({r["layer"] for r in rows if r["metric"] == metric})  # noqa: E731
    assert layers("qkai") == [0, 2]  # rank 0 measures layers 0 and 2; rank 1 (refused) spools 1 and 3
    rank1 = tmp_path / "spool" / "tests" / "fsdp" / "rank-1"
    (synced,) = sync(rank1, collector.url)
    assert synced.left == 0 and synced.delivered == STEPS
    with collector.client() as c:
        rows = [json.loads(line) for line in c.export(run["id"], "jsonl")]
    step0 = {(r["metric"], r["layer"]): r["value"] for r in rows if r["step"] == 0 and r["head"] == -1}
    ref = result["reference"]["layers"]
    for metric in ("qkai", "qkai_max", "stable_rank", "qk_cos", "attn_entropy", "attn_top1", "pr_q", "logit_std"):
        for layer in range(4):
            assert step0[(metric, layer)] == pytest.approx(ref[metric][layer], rel=1e-4, abs=1e-6), (metric, layer)
    for step in range(STEPS):  # every layer of every step, exactly once
        assert sorted(r["layer"] for r in rows if r["step"] == step and r["metric"] == "qkai") == [0, 1, 2, 3]
    qkai = {(r["step"], r["layer"]): r["value"] for r in rows if r["metric"] == "qkai" and r["head"] == -1}
    for step in range(STEPS):  # the weights each step's forward ran with, not those after its update
        reported = [qkai[(step, layer)] for layer in range(4)]
        assert reported == pytest.approx(result["before"][step], rel=1e-4, abs=1e-6), step
        assert reported != pytest.approx(result["after"][step], rel=1e-4, abs=1e-6), step
    rank0, rank1 = result["applied"]
    assert rank0 == rank1  # every rank applies the same lambdas at the same step
    assert all(len(v) == 4 for v in rank0) and rank0[0] == [0.0] * 4  # no evidence yet: no penalty
