"""``qkwatch demo`` end to end, shortened: the band forms in the vanilla run and RAA holds it, in the collector's data.

The demo trains ``collapse_cpu`` twice (vanilla and RAA) into a real collector; here it is cut to
240 steps with the induced collapse from step 40 to 160 (the full demo: 800 steps, 150 to 650).
Everything asserted is read back from the collector's database after the demo stopped it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.live import ROOT, LiveCollector

pytestmark = pytest.mark.slow

SHORT = [
    "train.steps=240",
    "intervention.collapse_start=40",
    "intervention.collapse_ramp=120",
    "train.report_every=10",
    "train.log_every=10",
    "checkpoint.every=1000",
]
BAND = [3, 4, 5]


def _band_mean(row: list, layers: list[int]) -> float:
    return sum(row[i] for i in layers) / len(layers)


def test_demo_shows_the_band_forming_without_raa_and_held_with_it(tmp_path: Path) -> None:
    sets = [x for kv in SHORT for x in ("--set", kv)]
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "demo", "--dir", str(tmp_path), *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    link = re.search(r"live page:\s+(http://127\.0\.0\.1:\d+)/\?run=(\w+)&run=(\w+)", out)
    assert link, out
    assert "HTTP Request" not in out + done.stderr  # httpx is quiet: the link is not buried
    assert re.search(r"alerts that fired\s+collapse_band, qkai_high\s+none", out), out
    # the vanilla run ends with its band collapsed: its alerts ended with it while firing, and the tag stays
    assert re.search(r"still firing at the end\s+ALERT (collapse_band|qkai_high)[, \w]*\s+none\n", out), out
    assert re.search(r"status\s+finished\s+finished", out), out
    with pytest.raises(httpx.ConnectError):  # the collector stopped with the demo
        httpx.get(f"{link.group(1)}/healthz", timeout=2)

    with LiveCollector(tmp_path) as collector, collector.client() as client:
        runs = {r["name"].split("-")[0]: r for r in client.runs(project="demo")["data"]}
        assert {runs["vanilla"]["id"], runs["raa"]["id"]} == {link.group(2), link.group(3)}
        assert runs["vanilla"]["status"] == runs["raa"]["status"] == "finished"
        qkai = {v: client.heatmap(runs[v]["id"], "qkai", max_steps=20_000) for v in ("vanilla", "raa")}
        vanilla, raa = qkai["vanilla"]["values"], qkai["raa"]["values"]
        outside = [i for i in range(8) if i not in BAND]
        # the band forms: below 0.5 at the first report, past 0.70 by the end; the other layers stay below 0.5
        assert _band_mean(vanilla[0], BAND) < 0.5 and _band_mean(vanilla[-1], BAND) >= 0.70
        assert max(row[i] for row in vanilla for i in outside) < 0.5
        # RAA holds it (seed 000: 0.42-0.49; tau = 0.45 r). The full demo peaks at 0.54; here the
        # pressure ramps 4x steeper while RAA's lambdas reach the trainer by polling (5 s, more steps
        # on a loaded machine), so the peak may overshoot a little: one run under the full suite read 0.552
        assert max(_band_mean(row, BAND) for row in raa) <= 0.60
        alerts = {v: {a["rule"] for a in client.alerts(run=runs[v]["id"])["data"]} for v in ("vanilla", "raa")}
        assert "collapse_band" in alerts["vanilla"] and not alerts["raa"]
        # RAA's schedule flagged the band and PAR acted there
        lam = client.heatmap(runs["raa"]["id"], "lambda", max_steps=20_000)["values"][-1]
        par = client.heatmap(runs["raa"]["id"], "par", max_steps=20_000)["values"][-1]
        assert min(lam[i] for i in BAND) >= 0.5 * 5e-3 and all(par[i] > 0 for i in BAND)
