"""``qkwatch demo --natural`` end to end, shortened: four real trainings into a real collector that runs
the candidate detectors, and a closing table whose every figure is read back from that collector.

Cut to 60 steps (held-out loss every 20) from 800; nothing is induced. What the test holds is the
demo's honesty, not a result: each row's final held-out loss is the mean of the run's last three
evaluations as stored, the difference column is that against the safe twin, the per-rule steps are
firings of alerts the collector opened (at or after their onset; every rule it alerted on is shown),
the first alert is the earliest of them, what fired on the twin is said, the largest logit is the
largest stored, and nothing in the runs' reports was induced (no collapse intervention, no RAA but
in ``raa-hot``).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qkwatch.client.rest import Client
from qkwatch.demo.natural import serving
from tests.live import ROOT, LiveCollector, free_port

pytestmark = pytest.mark.slow

RUNS = ["vanilla-hot", "vanilla-safe", "qk_norm-hot", "raa-hot"]


def test_natural_demo_table_is_what_the_collector_holds(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "qkwatch.cli",
        "demo",
        "--natural",
        "--no-serve",
        "--dir",
        str(tmp_path),
        "--port",
        str(free_port()),
        *("--set", "train.steps=60", "--set", "train.val_every=20"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(done.stdout, done.stderr)  # shown when the test fails
    assert done.returncode == 0
    assert "nothing induced" in done.stdout and "does not show" in done.stdout
    table, by_rule, runs_order = {}, {}, []
    lines = done.stdout.splitlines()
    for i, line in enumerate(lines):
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] in RUNS:
            table[cells[0]] = cells
        if cells and cells[0] == "first fired at step":
            runs_order = cells[1:]
            for row in lines[i + 1 :]:
                if not row.strip() or row.startswith("  on the safe twin"):
                    break
                rule, *steps = re.split(r"\s{2,}", row.strip())
                by_rule[rule] = dict(zip(runs_order, steps, strict=True))
    assert sorted(table) == sorted(RUNS) and sorted(runs_order) == sorted(RUNS), done.stdout
    assert set(by_rule) >= {"qkai_high", "attn_one_hot", "logit_growth"}, done.stdout
    twin_line = next(line for line in lines if line.startswith("  on the safe twin (lr 0.003"))

    collector = LiveCollector(tmp_path / "natural")
    collector.start()
    try:
        with Client(collector.url) as client:
            runs = {r["name"].removeprefix("natural-"): r for r in client.runs(project="demo")["data"]}
            assert sorted(runs) == sorted(RUNS)
            finals = {}
            for run, record in runs.items():
                assert record["status"] == "finished" and record["last_step"] == 59
                val = [float(v) for v in client.series(record["id"], "val_loss").values]
                assert len(val) >= 3
                finals[run] = sum(val[-3:]) / 3
                config = record["config"]
                assert config["intervention"]["kind"] == "none", config["intervention"]
                assert config["model"]["variant"] == ("qk_norm" if run == "qk_norm-hot" else "vanilla")
                assert config["raa"]["enabled"] is (run == "raa-hot")
                assert config["optim"]["lr"] == (0.003 if run == "vanilla-safe" else 0.03)
            for run, cells in table.items():
                _, final, diff, first, _visible, peak = cells
                assert float(final) == pytest.approx(finals[run], abs=6e-4)
                if run == "vanilla-safe":
                    assert diff == "(twin)"
                else:
                    assert float(diff) == pytest.approx(finals[run] - finals["vanilla-safe"], abs=1.1e-3)
                # every rule shown firing opened an alert in the collector, at or after its condition's onset,
                # and no rule the collector alerted on is shown as silent
                alerts = client.alerts(run=runs[run]["id"], limit=1000)["data"]
                shown = {rule: int(steps[run]) for rule, steps in by_rule.items() if steps[run] != "-"}
                assert set(shown) == {a["rule"] for a in alerts}
                for rule, step in shown.items():
                    assert min(a["onset_step"] for a in alerts if a["rule"] == rule) <= step <= 59
                earliest = min(shown.items(), key=lambda kv: (kv[1], kv[0]), default=None)
                assert first == (f"{earliest[0]} @ {earliest[1]}" if earliest else "none")
                if run == "vanilla-safe":
                    assert ("nothing fired on it" in twin_line) == (not shown)
                    assert all(f"{rule} @ {step}" in twin_line for rule, step in shown.items())
                stored = client.heatmap(runs[run]["id"], "logit_max", max_steps=20_000)["values"]
                largest = max(v for row in stored for v in row if v is not None and math.isfinite(v))
                assert float(peak) == pytest.approx(largest, abs=0.51)
            # what the demo prints while it serves: the report command runs as printed, hot beside twin
            printed = serving(collector.url, {run: runs[run]["id"] for run in RUNS}, tmp_path / "natural")
            assert f"run={runs['raa-hot']['id']}&metric=logit_max" in printed
            (command,) = re.findall(r"^  (\S+ report .*)$", printed, re.M)
            env = {k: v for k, v in os.environ.items() if k not in ("QKWATCH_URL", "QKWATCH_TOKEN")}
            done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            html = (tmp_path / "natural" / "report.html").read_text()
            assert "fig-heatmap-logit_max-0" in html and "fig-heatmap-logit_max-1" in html
            assert "demo/natural-vanilla-hot" in html and "demo/natural-vanilla-safe" in html
    finally:
        collector.stop()
