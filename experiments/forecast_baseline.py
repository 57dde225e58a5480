"""The QKAI forecast against the constant guess, on the held-out collapse seeds (issue 31).

The forecast users are given (``qkai_forecast`` in ``qkwatch/dashboards/rules/detectors.yml``) was
chosen on the demo's **induced** collapse band, seeds 0-7 (``python -m experiments.instability
--forecast``). Whether it earns its place is judged here against the simplest forecast a user
already has, fixed before this file's numbers were first computed:

* **The constant guess**: "a layer that crosses does so at step X", X the median over the tune runs
  (seeds 0-7) of every layer's first step with QKAI above the collapse threshold. It needs no
  fitting and no alert; it is what someone who has seen the tune runs would say.
* Both are scored at the same moments, the test runs' (seeds 8-11) forecast alerts whose layer then
  crosses: the forecast's error is ``|predicted - actual| / (actual - fired)``, the constant guess's
  ``|X - actual| / (actual - fired)``.
* **The forecast beats the constant guess when its median error over those forecasts is lower.**
  Only then does it stay among the suggested rules; the paired wins and a bootstrap interval over
  the test runs are shown beside it, and do not change the verdict.

Also counted: the test forecasts whose layer never crossed, and the test layers that crossed with no
forecast before them. Every step of the twelve runs is kept in
``experiments/results/instability_collapse_runs.npz`` and everything is recomputed from it:

    python -m experiments.instability --runs experiments/instability_runs.yml --forecast --train-only
    python -m experiments.forecast_baseline --export     # the 12 runs, every step, into the npz
    python -m experiments.forecast_baseline              # experiments/results/instability_forecast_baseline.json
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.early_warning.instability_data import RunRecord
from qkwatch.client.backtest import replay
from qkwatch.rules.ruleset import RuleSet

CAMPAIGN = "instability"
TUNE_SEEDS = range(0, 8)
TEST_SEEDS = range(8, 12)
BOOTSTRAP = 10_000


def names(seeds: Sequence[int] | range) -> list[str]:
    return [f"collapse-vanilla-s{s}" for s in seeds]


def crossings(record: RunRecord, threshold: float, after: int = -1) -> dict[int, int]:
    """Layer -> the first report step after ``after`` with QKAI above ``threshold``."""
    out: dict[int, int] = {}
    for report in sorted(record.history.reports, key=lambda r: r.step):
        if report.step <= after:
            continue
        for layer, value in enumerate(report.layers.get("qkai") or []):
            if value is not None and value > threshold and layer not in out:
                out[layer] = report.step
    return out


def constant_guess(tune: Sequence[RunRecord], threshold: float) -> float:
    """The median over the tune runs of every layer's first crossing step."""
    steps = [step for r in tune for step in crossings(r, threshold).values()]
    if not steps:
        raise ValueError("no tune layer crossed the threshold: there is no constant guess to make")
    return float(statistics.median(steps))


def forecasts(rule: Mapping[str, Any], runs: Sequence[RunRecord], threshold: float) -> list[dict[str, Any]]:
    """Every alert of the forecast rule on ``runs``, with the step its layer then crossed (None: never)."""
    rs = RuleSet.from_mapping({"rules": [dict(rule)]}, threshold)
    out = []
    for r in runs:
        for firing in replay(rs, r.history.reports):
            if firing.predicted_step is None:
                continue
            (layer,) = firing.layers
            actual = crossings(r, threshold, after=firing.step).get(layer)
            out.append(
                {
                    "run": r.name,
                    "layer": layer,
                    "fired": firing.step,
                    "predicted": firing.predicted_step,
                    "actual": actual,
                }
            )
    return out


def compare(
    rule: Mapping[str, Any], tune: Sequence[RunRecord], test: Sequence[RunRecord], threshold: float
) -> dict[str, Any]:
    guess = constant_guess(tune, threshold)
    rows = forecasts(rule, test, threshold)
    for row in rows:
        if row["actual"] is not None:
            ahead = max(row["actual"] - row["fired"], 1)
            row["forecast_error"] = abs(row["predicted"] - row["actual"]) / ahead
            row["constant_error"] = abs(guess - row["actual"]) / ahead
    scored = [row for row in rows if row["actual"] is not None]
    warned = {(row["run"], row["layer"]) for row in scored}
    crossed = [(r.name, layer, step) for r in test for layer, step in crossings(r, threshold).items()]
    missed = [{"run": n, "layer": layer, "crossed": step} for n, layer, step in crossed if (n, layer) not in warned]
    forecast_median = statistics.median(row["forecast_error"] for row in scored) if scored else None
    constant_median = statistics.median(row["constant_error"] for row in scored) if scored else None
    return {
        "rule": dict(rule),
        "threshold": threshold,
        "tune_runs": [r.name for r in tune],
        "test_runs": [r.name for r in test],
        "constant_guess_step": guess,
        "forecasts": rows,
        "scored": len(scored),
        "never_crossed": len(rows) - len(scored),
        "crossings_without_forecast": missed,
        "test_layers_crossed": len(crossed),
        "forecast_median_error": forecast_median,
        "constant_median_error": constant_median,
        "forecast_wins": sum(row["forecast_error"] < row["constant_error"] for row in scored),
        "median_lead_steps": statistics.median(row["actual"] - row["fired"] for row in scored) if scored else None,
        "difference_interval": bootstrap_difference(scored),
        "forecast_beats_constant": forecast_median is not None
        and constant_median is not None
        and forecast_median < constant_median,
    }


def bootstrap_difference(scored: Sequence[Mapping[str, Any]], seed: int = 0) -> list[float] | None:
    """The 95 % percentile interval of median(forecast error) - median(constant error), resampling
    the test runs (a run's forecasts travel together)."""
    by_run: dict[str, list[Mapping[str, Any]]] = {}
    for row in scored:
        by_run.setdefault(row["run"], []).append(row)
    if len(by_run) < 2:
        return None
    rng = random.Random(seed)
    keys = sorted(by_run)
    diffs = []
    for _ in range(BOOTSTRAP):
        sample = [row for k in rng.choices(keys, k=len(keys)) for row in by_run[k]]
        diffs.append(
            statistics.median(r["forecast_error"] for r in sample)
            - statistics.median(r["constant_error"] for r in sample)
        )
    diffs.sort()
    return [diffs[int(0.025 * BOOTSTRAP)], diffs[int(0.975 * BOOTSTRAP) - 1]]


def data_path() -> Path:
    from experiments.common import RESULTS

    return RESULTS / "instability_collapse_runs.npz"


def results_path() -> Path:
    from experiments.common import RESULTS

    return RESULTS / "instability_forecast_baseline.json"


def export() -> Path:
    from experiments.common import Campaign, log
    from experiments.early_warning import instability_data

    wanted = names(TUNE_SEEDS) + names(TEST_SEEDS)
    with Campaign(CAMPAIGN) as campaign:
        missing = [n for n in wanted if not campaign.run_id(n)]
        if missing:
            raise SystemExit(f"{len(missing)} collapse runs are not trained yet, e.g. {missing[0]}")
        records = instability_data.fetch(campaign.client, CAMPAIGN, wanted)
    path = instability_data.save(records, data_path())
    log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(records)} runs)")
    return path


def analyse() -> dict[str, Any]:
    """The comparison from the committed npz and the forecast as ``detectors.yml`` ships it."""
    from experiments.early_warning import instability_data
    from experiments.early_warning.detectors import shipped_forecast
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD

    records = instability_data.load(data_path())
    tune = [records[n] for n in names(TUNE_SEEDS)]
    test = [records[n] for n in names(TEST_SEEDS)]
    return compare({"name": "qkai_forecast", **shipped_forecast()}, tune, test, COLLAPSE_THRESHOLD)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from experiments.common import save_json

    p = argparse.ArgumentParser(prog="python -m experiments.forecast_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--export", action="store_true", help="read the 12 trained collapse runs into the npz first")
    args = p.parse_args(argv)
    if args.export:
        export()
    result = analyse()
    save_json(result, results_path())
    shown = {k: v for k, v in result.items() if k not in ("forecasts", "crossings_without_forecast")}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
