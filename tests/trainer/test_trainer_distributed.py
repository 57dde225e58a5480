"""FSDP2 over 2 gloo ranks on the CPU (``torchrun --nproc_per_node 2``), one launch for all checks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("QKWATCH_URL", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "fsdp_checks.py"),
        str(out),
    ]
    result = subprocess.run(
        cmd, cwd=tmp_path_factory.mktemp("cwd"), env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


pytestmark = pytest.mark.slow


def test_sharded_initial_weights_equal_the_single_process_ones(report):
    assert report["gradients"]["init_equal"]


@pytest.mark.parametrize("part", ["ce_plus_par", "par_only"])
def test_gradients_reaching_the_shards_equal_single_process_ones(report, part):
    """Averaged over the ranks, not summed (pytorch#162338): a sum would show a ratio of 2."""
    checked = report["gradients"][part]
    assert checked
    for name, c in checked.items():
        assert c["max_abs_err"] <= 1e-5 * max(1.0, c["ref_max"]), (name, c)
        assert c["ratio"] == pytest.approx(1.0, abs=1e-4), (name, c)
    if part == "par_only":  # PAR reaches the query/key weights and the rotation of every flagged layer
        for i in range(4):
            for leaf in ("q_proj.weight", "k_proj.weight"):
                assert checked[f"blocks.{i}.attn.{leaf}"]["ref_max"] > 1e-4


@pytest.mark.parametrize("kind", ["forced_k_contraction", "freeze_q", "k_spectrum_clamp"])
def test_interventions_on_shards_equal_the_unsharded_surgery(report, kind):
    assert report["interventions"][kind] < 1e-5


def test_resumed_sharded_run_has_the_uninterrupted_loss_curve(report):
    straight, resumed = report["resume"]["straight"], report["resume"]["resumed"]
    assert [s for s, _ in straight] == list(range(6)) == [s for s, _ in resumed]
    for (step, a), (_, b) in zip(straight, resumed, strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7), step
    assert report["resume"]["steps"] == [6, 6]


def test_debug_cpu_runs_to_the_end_on_two_gloo_ranks(report):
    r = report["debug_cpu"]
    assert r["exit"] == 0 and r["last_step"] == 59 and r["exported"]
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["losses"][-1] < r["losses"][0]
    assert r["layers"] == [4]
