"""``python -m experiments.instability --report`` recomputes the committed page and scoreboard from the
committed per-step files alone (issue 31): the sweep's npz, its fixed outcome and the collapse runs' npz.

Nothing is trained and no collector runs: the page and the JSON written into a temporary folder must
equal, line for line and value for value, what is committed as ``docs/instability.md`` and
``experiments/results/instability_sweep.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import instability, sweep_analysis

ROOT = Path(__file__).resolve().parents[2]


def test_report_recomputes_the_committed_page_and_scoreboard_from_the_committed_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sweep_analysis, "results_path", lambda: tmp_path / "instability_sweep.json")
    assert instability.main(["--report", "--docs", str(tmp_path)]) == 0
    assert (tmp_path / "instability.md").read_text() == (ROOT / "docs" / "instability.md").read_text()
    committed = json.loads((ROOT / "experiments" / "results" / "instability_sweep.json").read_text())
    assert json.loads((tmp_path / "instability_sweep.json").read_text()) == committed
