"""``python -m experiments.instability --report`` recomputes the committed page and scoreboards from the
committed per-step files alone: the tune recipe's npz and fixed outcome (issue 31), the collapse runs' npz,
and issue 40's held-out recipes' npz, their fixed outcome and the committed tuning (which the search must
give again from the tune recipe's runs).

Nothing is trained and no collector runs: the page and the JSON written into a temporary folder must
equal, line for line and value for value, what is committed as ``docs/instability.md``,
``experiments/results/instability_sweep.json`` and ``experiments/results/yardstick.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import instability, sweep_analysis, yardstick

ROOT = Path(__file__).resolve().parents[2]


def test_report_recomputes_the_committed_page_and_scoreboard_from_the_committed_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sweep_analysis, "results_path", lambda: tmp_path / "instability_sweep.json")
    monkeypatch.setattr(yardstick, "scores_path", lambda: tmp_path / "yardstick.json")
    assert yardstick.ready()  # issue 40's files are committed: the page leads with them
    assert instability.main(["--report", "--docs", str(tmp_path)]) == 0
    assert (tmp_path / "instability.md").read_text() == (ROOT / "docs" / "instability.md").read_text()
    for name in ("instability_sweep.json", "yardstick.json"):
        committed = json.loads((ROOT / "experiments" / "results" / name).read_text())
        assert json.loads((tmp_path / name).read_text()) == committed, name
