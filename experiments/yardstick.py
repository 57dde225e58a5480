"""Issue 40: does a qkwatch rule warn earlier than the loss, on recipes nobody tuned anything on?

Everything here reads committed files only: the per-step runs of the tune recipe
(``instability_sweep_runs.npz``, 144 runs of ``instability_small``) and of the held-out recipes
(``heldout_sweep_runs.npz``, ``heldout_long`` and ``heldout_code``), and the outcomes fixed for each
before anything was scored on it. In order (the commits show it):

1. ``--tune``: on the tune recipe's seeds 0-2, every detector family and every loss-only family is
   searched the same way (:func:`experiments.early_warning.rule_search.choose`); the tuned loss-only baseline is the
   loss family the same criterion puts first. Written to ``yardstick_tuned.json`` and committed before
   the held-out runs are scored.
2. ``--fix-outcome``: each held-out recipe's best rates and delta from its losses alone
   (``heldout_sweep_outcome.json``), committed before scoring.
3. ``--score``: the chosen rules replayed through the collector's own evaluator on every run, checked
   against the search's replica, and scored per recipe and side (``yardstick.json``).

How a run is judged, which side it is on, what a false alarm and a lead are, when a raa run counts as
its vanilla twin and the bar: ``experiments/heldout_sweep.yml``'s header, fixed before the held-out runs
were trained; the code below is that text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, ROOT, save_json
from experiments.early_warning.instability_data import RunRecord
from experiments.early_warning.yardstick_judging import (
    TUNE_RECIPE,
    TUNE_SEEDS,
    Judged,
    Run,
    fix_outcome,
    judge_runs,
    tune,
)
from experiments.early_warning.yardstick_scoring import scoreboard

TUNE_SUITE, HELDOUT_SUITE = ROOT / "instability_sweep.yml", ROOT / "heldout_sweep.yml"
TUNE_DATA, HELDOUT_DATA = RESULTS / "instability_sweep_runs.npz", RESULTS / "heldout_sweep_runs.npz"
TUNE_OUTCOME, HELDOUT_OUTCOME = RESULTS / "instability_sweep_outcome.json", RESULTS / "heldout_sweep_outcome.json"
TUNED, SCORES = RESULTS / "yardstick_tuned.json", RESULTS / "yardstick.json"
HELDOUT_CAMPAIGN = "heldout_sweep"


# --- the runs ------------------------------------------------------------------------------------------------


def suite_runs(path: Path) -> list[Run]:
    from experiments.suite import load_runs

    return [Run(r.name, r.recipe, r.variant, float(r.lr or 0.0), r.seed) for r in load_runs(path)]


def load_records(path: Path, runs: Sequence[Run]) -> dict[str, RunRecord]:
    """The runs of ``runs`` in the npz; SystemExit naming what is missing."""
    from experiments.early_warning import instability_data

    records = instability_data.load(path) if path.exists() else {}
    missing = [r.name for r in runs if r.name not in records]
    if missing:
        raise SystemExit(
            f"{path.name} lacks {len(missing)} of {len(runs)} runs (e.g. {missing[0]}): train them "
            f"(python -m experiments.instability --runs experiments/heldout_sweep.yml --campaign "
            f"{HELDOUT_CAMPAIGN} --train-only), then python -m experiments.yardstick --export"
        )
    return {r.name: records[r.name] for r in runs}


def outcomes() -> dict[str, dict[str, Any]]:
    """Each recipe's fixed outcome: the tune recipe's (issue 31) and the held-out ones'."""
    tune = json.loads(TUNE_OUTCOME.read_text())
    held = json.loads(HELDOUT_OUTCOME.read_text())["recipes"] if HELDOUT_OUTCOME.exists() else {}
    return {TUNE_RECIPE: tune, **held}


# --- the command line ----------------------------------------------------------------------------------------


def all_runs() -> tuple[list[Run], dict[str, RunRecord]]:
    tune_runs, held_runs = suite_runs(TUNE_SUITE), suite_runs(HELDOUT_SUITE)
    records = {**load_records(TUNE_DATA, tune_runs), **load_records(HELDOUT_DATA, held_runs)}
    return [*tune_runs, *held_runs], records


def tune_runs_judged() -> list[Judged]:
    runs = suite_runs(TUNE_SUITE)
    judged = judge_runs(runs, load_records(TUNE_DATA, runs), outcomes())
    return [j for j in judged if j.run.seed in TUNE_SEEDS]


def results() -> dict[str, Any]:
    """The whole analysis from the committed files; SystemExit when a stage's file is missing or moved."""
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD

    if not HELDOUT_OUTCOME.exists():
        raise SystemExit(f"{HELDOUT_OUTCOME.name} is missing: python -m experiments.yardstick --fix-outcome, commit")
    committed = json.loads(TUNED.read_text())
    runs, records = all_runs()
    judged = judge_runs(runs, records, outcomes())
    tuned = tune([j for j in judged if j.run.recipe == TUNE_RECIPE and j.run.seed in TUNE_SEEDS])
    if json.loads(json.dumps(tuned)) != committed:
        raise SystemExit(f"the search no longer gives what {TUNED.name} holds: the tuning is not moved")
    board = scoreboard(judged, tuned, COLLAPSE_THRESHOLD)
    return {"tuned": tuned, "outcomes": outcomes(), "collapse_threshold": COLLAPSE_THRESHOLD, **board}


def ready() -> bool:
    """Whether every stage's file is committed: the held-out runs, their outcome and the tuning."""
    return HELDOUT_DATA.exists() and HELDOUT_OUTCOME.exists() and TUNED.exists()


def scores_path() -> Path:
    return SCORES


def export() -> Path:
    """The held-out runs the campaign's collector holds finished, added to their npz (kept runs stay)."""
    from experiments.early_warning import instability_data

    return instability_data.export(suite_runs(HELDOUT_SUITE), HELDOUT_CAMPAIGN, HELDOUT_DATA)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m experiments.yardstick", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", action="store_true", help="the held-out runs from their collector into the npz")
    p.add_argument("--tune", action="store_true", help="stage 1: search every family on the tune recipe")
    p.add_argument("--fix-outcome", action="store_true", help="stage 2: the held-out recipes' best rates and delta")
    p.add_argument("--score", action="store_true", help="stage 3: score everything (yardstick.json)")
    args = p.parse_args(argv)
    if args.export:
        print(f"wrote {export()}")
    if args.tune:
        if TUNED.exists():
            raise SystemExit(f"{TUNED} exists: the tuning is fixed and is not moved")
        print(json.dumps(save_json(tune(tune_runs_judged()), TUNED).name))
    if args.fix_outcome:
        if HELDOUT_OUTCOME.exists():
            raise SystemExit(f"{HELDOUT_OUTCOME} exists: the outcome is fixed and is not moved")
        runs = suite_runs(HELDOUT_SUITE)
        fixed = fix_outcome(runs, load_records(HELDOUT_DATA, runs))
        save_json(fixed, HELDOUT_OUTCOME)
        print(json.dumps(fixed, indent=1))
    if args.score:
        print(f"wrote {save_json(results(), scores_path())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
