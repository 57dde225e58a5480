"""The experiments' plumbing, for real: runs trained into a collector and read back through the client.

A campaign starts ``qkwatch serve`` on a loopback port, trains two tiny runs as subprocesses with the
agent reporting to it, evaluates one with ``qkwatch eval``, and the helpers read everything back.
What comes back is checked against an independent source, the runs' own ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments.common import Campaign, RunSpec, last, md_table, mean_sd, read_run

pytestmark = pytest.mark.timeout(300)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_campaign_trains_evaluates_reads_back_and_resumes(tmp_path: Path) -> None:
    specs = [
        RunSpec(
            "a",
            "debug_cpu",
            [
                "train.steps=10",
                "train.report_every=5",
                "train.qkai_every=5",
                "model.max_seq_len=128",
                "train.seq_len=64",
            ],
            [("perplexity", "64,128")],
        ),
        RunSpec(
            "b",
            "seed001_grid",
            [
                "train.epochs=null",
                "train.steps=10",
                "train.report_every=5",
                "train.qkai_every=5",
                "train.global_batch_size=2",
                "model.n_layers=2",
            ],
        ),
    ]
    with Campaign("t", root=tmp_path, workers=2, samples=3) as campaign:
        ids = campaign.run(specs)
        assert set(ids) == {"a", "b"} and all(ids.values())
        for spec in specs:
            run = ids[spec.name]
            assert campaign.client.run(run)["status"] == "finished"
            local = _jsonl(tmp_path / "runs" / spec.name / "metrics.jsonl")
            grids, s = read_run(campaign.client, run, ["qkai"])
            steps, qkai = grids["qkai"]
            logged = {row["step"]: row["qkai"] for row in local if "qkai" in row}
            common = sorted(set(steps.tolist()) & set(logged))
            assert common, (steps, sorted(logged))
            for step in common:  # the collector's per-layer values are the trainer's own
                np.testing.assert_allclose(qkai[steps.tolist().index(step)], logged[step], rtol=1e-5)
            val = [row["val_loss"] for row in local if "val_loss" in row]
            assert last(s["val_loss"]) == pytest.approx(val[-1], rel=1e-6)
        evals = read_run(campaign.client, ids["a"], [])[1]
        assert {"ppl_64", "ppl_128"} <= set(evals)
        assert all(1 < last(evals[k]) < 300 for k in ("ppl_64", "ppl_128"))  # 256 symbols: ppl below 256-ish
        # the evaluation resumed the run to log its results, and left the training's config as it was
        stored = campaign.client.run(ids["a"])["config"]
        assert stored == json.loads((tmp_path / "runs" / "a" / "config.json").read_text()) | {"n_layers": 4}
        assert stored["schedule"]["lambda_0"] == 1e-3  # debug_cpu's, not the default 1e-4
        assert campaign.done(specs[0]) and campaign.done(specs[1])
        log_a = (tmp_path / "logs" / "a.log").stat().st_mtime
        assert campaign.run(specs) == ids  # resumes: nothing trained twice
        assert (tmp_path / "logs" / "a.log").stat().st_mtime == log_a


def test_a_failed_run_is_named(tmp_path: Path) -> None:
    with Campaign("t", root=tmp_path, workers=1) as campaign, pytest.raises(RuntimeError, match="bad"):
        campaign.run([RunSpec("bad", "debug_cpu", ["model.n_layers=-1"])])


def test_table_helpers() -> None:
    assert md_table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    assert mean_sd([1.0, 3.0], ".1f") == "2.0 ± 1.4"
    assert mean_sd([math.nan]) == "-"
    assert math.isnan(last(None))
