"""The instability sweep judged by where each run ends, and its detectors scored against baselines (issue 31).

Everything here reads the sweep's per-step file (``experiments.early_warning.instability_data``) and nothing else,
in two stages whose order the commits show:

1. :func:`fix_outcome` (``--fix-outcome``): each variant's best rate (the lowest mean final
   held-out loss over the tune and test seeds), the seed-to-seed spread of that final loss there,
   and ``delta`` from it (``qkwatch.client.outcomes.choose_delta``). Written to
   ``experiments/results/instability_sweep_outcome.json`` and committed before any detector is scored.
2. :func:`scoreboard`: every run judged (``judge``: diverged, degraded, spiked, healthy) with its
   loss-visible step (``loss_visible_step``); each detector family's parameters chosen on the tune
   seed (most bad runs flagged with no alert on a healthy one), then scored on the test seeds and,
   once, on the held-out seed, beside the baselines a user already has: the loss-only alert and
   "alert from the start when the rate is at least X" (X chosen on tune the same way).

A run is *bad* when it diverged, degraded or spiked; an alert on a healthy run (one that ended
within ``delta`` of its reference) is a false alarm. A detector's lead on a bad run is its
loss-visible step (the end of the run when the loss alone never showed it) minus the step of its
first alert: negative means qkwatch was later than the loss.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.common import save_json
from experiments.early_warning.instability_data import RunRecord
from experiments.early_warning.sweep_scoring import Sweep, fix_outcome, scoreboard
from qkwatch.rules.ruleset import RuleSet

SUITE = Path(__file__).resolve().parent / "instability_sweep.yml"
CAMPAIGN = "instability_sweep"


def sweep_runs(path: Path = SUITE) -> list[Sweep]:
    from experiments.suite import load_runs

    return [Sweep(r.name, r.variant, float(r.lr or 0.0), r.seed, r.split) for r in load_runs(path)]


def data_path() -> Path:
    from experiments.common import RESULTS

    return RESULTS / f"{CAMPAIGN}_runs.npz"


def outcome_path() -> Path:
    from experiments.common import RESULTS

    return RESULTS / f"{CAMPAIGN}_outcome.json"


def export() -> Path:
    """Add every run of the sweep its campaign's collector holds finished to the per-step file.

    The file is the sweep's memory across machines: the runs it holds are kept as they are and not
    trained again (``experiments.instability`` skips them), so a sweep stopped on one machine goes on
    from the committed file on another.
    """
    from experiments.early_warning import instability_data

    return instability_data.export(sweep_runs(), CAMPAIGN, data_path())


def complete(runs: Sequence[Sweep], records: Mapping[str, RunRecord], what: str) -> None:
    """Stop, naming what is missing, unless every run of ``runs`` is in ``records``."""
    missing = [r.name for r in runs if r.name not in records]
    if missing:
        raise SystemExit(
            f"{what} needs {len(runs)} runs and {data_path().name} lacks {len(missing)} of them "
            f"(e.g. {missing[0]}): train the rest (python -m experiments.instability --runs "
            f"experiments/instability_sweep.yml --train-only), then python -m experiments.sweep_analysis --export"
        )


def main(argv: list[str] | None = None) -> int:
    import argparse

    from experiments.early_warning import instability_data

    p = argparse.ArgumentParser(prog="python -m experiments.sweep_analysis", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", action="store_true", help="read the trained sweep from its collector into the npz")
    p.add_argument("--fix-outcome", action="store_true", help="stage 1: best rates, spread and delta")
    p.add_argument("--score", action="store_true", help="stage 2: the scoreboard, from the npz and the fixed outcome")
    args = p.parse_args(argv)
    if args.export:
        export()
    if args.fix_outcome:
        if outcome_path().exists():
            raise SystemExit(f"{outcome_path()} exists: the outcome is fixed and is not moved")
        runs, records = sweep_runs(), instability_data.load(data_path())
        complete([r for r in runs if r.split in ("tune", "test")], records, "fixing the outcome")
        fixed = fix_outcome(runs, records)
        save_json(fixed, outcome_path())
        print(json.dumps(fixed, indent=1))
    if args.score:
        save_json(score_sweep(), results_path())
    return 0


def results_path() -> Path:
    from experiments.common import RESULTS

    return RESULTS / f"{CAMPAIGN}.json"


def score_sweep() -> dict[str, Any]:
    """The scoreboard from the committed files alone: the npz and the fixed outcome."""
    from experiments import forecast_baseline
    from experiments.early_warning import instability_data
    from experiments.early_warning.detectors import FAMILIES, FIXED, shipped_detectors
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD

    fixed = json.loads(outcome_path().read_text())
    runs, records = sweep_runs(), instability_data.load(data_path())
    complete(runs, records, "the scoreboard")
    board = scoreboard(
        runs,
        records,
        fixed,
        FAMILIES,
        FIXED,
        lambda rules: RuleSet.from_mapping({"rules": rules}, COLLAPSE_THRESHOLD),
        shipped_detectors(),
    )
    return {
        **board,
        "collapse_threshold": COLLAPSE_THRESHOLD,
        # recomputed from the collapse runs' committed npz, like everything else here
        "forecast_baseline": forecast_baseline.analyse() if forecast_baseline.data_path().exists() else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
