"""``qkwatch.read_reports(spool_dir)`` and ``qkwatch report --spool DIR``: a run's reports read from its
spool with no collector (issue 41, item 8). The reports are written by a real agent, offline or with
a collector URL that refuses connections, and compared with what the agent measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import qkwatch
from qkwatch import agent
from qkwatch.agent.shipping.disk_spool import Spool
from qkwatch.cli import main
from qkwatch.contract.offline_reports import SpoolError
from qkwatch.contract.spool_format import HEADER, MAGIC
from qkwatch.contract.values import decode_value
from tests.agent.test_weight_timing import tiny_qkai
from tests.agent.tiny import TinyGPT, train
from tests.live import ROOT

STEPS = 6
FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.2}


def spooled_records(path: Path) -> list[dict]:
    """The reports as the agent spooled them (its own private reader), for comparison."""
    spool = Spool(path)
    try:
        return [r.payload["report"] for r in spool.pending(10_000) if "report" in r.payload]
    finally:
        spool.close()


def run_agent(tmp_path: Path, url: str | None, run: str = "offline") -> tuple[agent.Agent, list[list[float]], Path]:
    """A TinyGPT trained ``STEPS`` steps with the agent measuring every step; the QKAI of the weights
    each step's forward ran with (the closed form), and the rank's spool folder."""
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(model, url=url, project="tests", run=run, spool=str(tmp_path / "spool"), every=1, **FAST)
    before: list[list[float]] = []
    original = a.step

    def step(s: int) -> None:
        original(s)
        before.append(tiny_qkai(model))

    a.step = step  # type: ignore[method-assign]  # records the weights right after step(s), before the forward
    train(a, model, STEPS)
    return a, before, tmp_path / "spool" / "tests" / run / "rank-0"


def test_read_reports_gives_what_the_offline_agent_measured(tmp_path: Path) -> None:
    """Offline (no URL): every step's report, in step order, with the values the agent spooled, the
    closed-form QKAI of each step's weights, the logged loss, and the run's identity and end status."""
    a, before, rank0 = run_agent(tmp_path, url=None)
    a.close(timeout=0.2)
    got = qkwatch.read_reports(tmp_path / "spool" / "tests" / "offline")  # the run's folder: every rank
    assert (got.project, got.run, got.ranks, got.damaged) == ("tests", "offline", 1, 0)
    assert got.steps == list(range(STEPS)) and len(got) == STEPS
    assert got.status == "finished" and got.config["n_layers"] == 4
    spooled = {r["step"]: r for r in spooled_records(rank0)}
    for report in got:
        want = spooled[report.step]
        assert report.model_dump(mode="json")["layers"] == want["layers"]
        assert report.scalars["loss"] == want["scalars"]["loss"]
        np.testing.assert_allclose(report.layers["qkai"], before[report.step], rtol=1e-4)
        assert all(0 < decode_value(v) < 1 for v in report.layers["attn_entropy"])  # type: ignore[operator]
    assert qkwatch.read_reports(rank0).steps == got.steps  # one rank's folder reads the same


def test_read_reports_while_the_collector_is_down_and_the_agent_still_runs(tmp_path: Path) -> None:
    """A collector URL that refuses connections: the reports stay in the spool, and they read while the
    agent still holds it (no lock is taken, nothing is changed: the agent then closes as usual)."""
    a, before, rank0 = run_agent(tmp_path, url="http://127.0.0.1:9", run="down")
    live = qkwatch.read_reports(rank0)
    assert live.steps == list(range(STEPS - 1)) and live.status is None  # step 5's report waits for close()
    a.close(timeout=0.5)
    got = qkwatch.read_reports(rank0)
    assert got.steps == list(range(STEPS)) and got.status == "finished" and got.damaged == 0
    for report in got:
        np.testing.assert_allclose(report.layers["qkai"], before[report.step], rtol=1e-4)
    assert len(spooled_records(rank0)) == STEPS  # still pending: nothing was delivered or acknowledged


def test_damaged_records_are_skipped_and_counted(tmp_path: Path) -> None:
    """Corrupt bytes between records and a record that is no report are skipped, counted, never raised."""
    a, _, rank0 = run_agent(tmp_path, url=None, run="damaged")
    a.close(timeout=0.2)
    (segment,) = sorted(rank0.glob("seg-*.log"))
    data = segment.read_bytes()
    second = data.index(MAGIC, 1)
    bad = json.dumps({"attempt_key": "x", "report": {"step": "not a step"}}).encode()
    invalid = HEADER.pack(MAGIC, len(bad), zlib.crc32(bad)) + bad
    segment.write_bytes(data[:second] + b"garbage" * 5 + invalid + data[second:])
    got = qkwatch.read_reports(rank0)
    assert got.damaged == 2 and got.steps == list(range(STEPS))


def test_ranks_are_merged_per_step(tmp_path: Path) -> None:
    """Two ranks' reports of a step (each measuring its own layers) read as one report of every layer."""
    run = tmp_path / "p" / "r"
    for rank, layers in ((0, [0.5, None]), (1, [None, 0.25])):
        spool = Spool(run / f"rank-{rank}")
        spool.write_meta({"project": "p", "name": "r", "config": {}, "rank": rank})
        report = {"step": 3, "time": 1.0 + rank, "layers": {"qkai": layers}, "scalars": {f"s{rank}": 1.0}}
        spool.append({"attempt_key": "k", "report": report})
        spool.close()
    (merged,) = qkwatch.read_reports(run)
    assert merged.layers["qkai"] == [0.5, 0.25] and merged.scalars == {"s0": 1.0, "s1": 1.0} and merged.time == 1.0


def test_a_path_that_is_no_spool_is_a_one_line_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(SpoolError, match=re.escape(str(path))):
            qkwatch.read_reports(path)
    assert main(["report", "--spool", str(tmp_path / "missing"), "--out", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path / "missing") in err and "not a qkwatch spool" in err


def test_qkwatch_report_spool_renders_the_runs_layers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``qkwatch report --spool DIR`` writes the report with the run's name, every layer's latest QKAI
    (the value of the last report) and the loss, read from the spool alone (no URL anywhere)."""
    a, before, rank0 = run_agent(tmp_path, url=None, run="render")
    a.close(timeout=0.2)
    out = tmp_path / "report.html"
    assert main(["report", "--spool", str(tmp_path / "spool" / "tests" / "render"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    assert "<h1>qkwatch report: tests/render</h1>" in page and "read from the spool" in page
    figures = re.findall(r'<div id="(fig-[^"]+)"', page)
    assert figures == [
        "fig-latest",
        "fig-loss",
        *(f"fig-heatmap-{m}-0" for m in ("qkai", "stable_rank", "attn_entropy", "logit_max", "lambda")),
        "fig-layers-0",
        "fig-lambdas-0",
    ]
    latest = [decode_value(v) for v in qkwatch.read_reports(rank0)[-1].layers["qkai"]]
    assert len(latest) == 4
    np.testing.assert_allclose(latest, before[-1], rtol=1e-4)  # what the last step's forward ran with
    assert f'"x":[0,1,2,3],"y":{json.dumps(latest, separators=(",", ":"))}' in page  # fig-latest: every layer
    assert f"<th>last step</th><td>{STEPS - 1}</td>" in page
    assert '<span class="status-finished">finished</span>' in page
    top = max(range(4), key=lambda i: latest[i])
    assert f"{latest[top]:.3f} (layer {top}, step {STEPS - 1})" in page  # highest latest qkai


def test_read_reports_loads_neither_torch_nor_the_collector(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "p" / "r" / "rank-0")
    spool.write_meta({"project": "p", "name": "r"})
    spool.append({"attempt_key": "k", "report": {"step": 0, "time": 1.0, "layers": {"qkai": [0.5]}}})
    spool.close()
    code = (
        "import sys, qkwatch; r = qkwatch.read_reports(sys.argv[1]); assert r.steps == [0], r; "
        "loaded = [m for m in ('torch', 'fastapi', 'sqlalchemy', 'httpx') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
