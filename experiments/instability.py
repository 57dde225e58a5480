"""``python -m experiments.instability``: trouble qkwatch did not make, and how early its alerts see it.

The suite trains the runs of a YAML file (``experiments/instability_runs.yml`` by default: a
learning-rate sweep in the style of Wortsman et al. 2023 over vanilla, qk_norm, sigma_reparam and
RAA; the key contraction alone, *induced*; no warmup at a high rate; healthy controls) into one
collector, through the agent, and reads every run back over REST. Then:

1. every run gets its outcome from its logged loss alone (``qkwatch.client.outcomes``: the rule
   was fixed before any detector was scored, and is not moved here);
2. each detector family's parameters are chosen on the ``tune`` split (most bad runs flagged
   before their outcome, with no firing on a healthy tune run), and scored on ``test``;
3. the scoreboard (``docs/instability.md``, its figures, ``experiments/results/instability.json``)
   reports recall, false alarms, lead in steps and reports, the forecast's error, the
   learning-rate sensitivity of each variant, and what RAA does on the contraction band.

``--train-only`` trains and stops; ``--report`` rewrites the page from the committed results alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, ROOT, Campaign, load, log, save, save_json
from experiments.early_warning import instability_data, instability_report
from experiments.early_warning.detectors import FAMILIES, FIXED, shipped_forecast
from experiments.early_warning.earlier_suite import (
    choose,
    contraction,
    detector_table,
    lr_sensitivity,
    read_back,
    ruleset,
    score,
)
from experiments.early_warning.forecast_study import FORECAST_GRID, forecast_errors, forecast_tuning
from experiments.suite import SuiteRun, load_runs
from qkwatch.client.outcomes import OutcomeRule

DEFAULT_RUNS = ROOT / "instability_sweep.yml"
"""The suite: issue 31's learning-rate sweep, judged by where each run ends (``experiments.sweep_analysis``)."""
EARLIER_RUNS = ROOT / "instability_runs.yml"
"""The earlier suite (spikes only; ``docs/instability-earlier.md``): ``--runs experiments/instability_runs.yml``."""


@dataclass
class Options:
    runs: Path = DEFAULT_RUNS
    campaign: str = "instability"
    root: Path | None = None
    workers: int = 2
    outcome: str = "delta=0.5,for=5,window=20"
    train_only: bool = False
    report_only: bool = False
    results: str = "instability"
    docs: Path | None = None
    png: bool = True
    forecast_only: bool = False


def train(opts: Options, runs: Sequence[SuiteRun]) -> None:
    """Train every run the campaign does not hold finished, seed by seed (a stopped sweep leaves whole seeds)."""
    with Campaign(opts.campaign, workers=opts.workers, root=opts.root) as campaign:
        campaign.run([r.spec() for r in sorted(runs, key=lambda r: r.seed)])


def analyse(opts: Options, runs: Sequence[SuiteRun]) -> dict[str, Any]:
    outcome = OutcomeRule.parse(opts.outcome)
    with Campaign(opts.campaign, workers=opts.workers, root=opts.root) as campaign:
        collapse = campaign.client.thresholds().collapse
        data = read_back(campaign.client, opts.campaign, runs, outcome)
    # Detectors are chosen and scored on trouble qkwatch did not make: induced runs are reported apart.
    tune = [d for d in data if d.run.split == "tune" and not d.run.induced]
    test = [d for d in data if d.run.split == "test" and not d.run.induced]
    induced = [d for d in data if d.run.induced]
    log(
        f"read {len(data)} runs: "
        + ", ".join(f"{k} {sum(d.outcome.label == k for d in data)}" for k in ("diverged", "spiked", "healthy"))
    )
    log("choosing each detector family's parameters on the tune split")
    chosen = choose(tune, collapse, outcome)
    return {
        "outcome_rule": outcome.describe(),
        "collapse_threshold": collapse,
        "runs": [d.row() for d in data],
        "families": FAMILIES,
        "fixed": FIXED,
        "chosen": chosen,
        "tune": detector_table(tune, chosen, collapse, outcome),
        "test": detector_table(test, chosen, collapse, outcome),
        "candidates_on_test": {
            family: [
                {
                    "rule": {"name": family, **params},
                    "score": score(test, ruleset([{"name": family, **params}], collapse), outcome)[0].to_json(),
                }
                for params in candidates
            ]
            for family, candidates in FAMILIES.items()
        },
        "induced": detector_table(induced, chosen, collapse, outcome),
        "shipped_forecast": shipped_forecast(),
        "forecast": forecast_errors(data, {**chosen, "shipped": {"rule": shipped_forecast()}}, collapse),
        "forecast_tuning": forecast_tuning(
            [d for d in induced if d.run.split == "tune"], [d for d in induced if d.run.split == "test"], collapse
        ),
        "lr_sensitivity": lr_sensitivity(data),
        "contraction": contraction(data),
    }


FORECAST_PRESSURE = "collapse band"
"""The runs where QKAI crosses the collapse threshold: the only ones on which a forecast's error is measured."""
FORECAST_RESULTS = "instability_forecast"
"""experiments/results/NAME.json of ``--forecast``; the page shows its choice when it exists."""


def analyse_forecast(opts: Options, runs: Sequence[SuiteRun]) -> dict[str, Any]:
    """The forecast's choice on the tune collapse runs and its error on the test ones (``--forecast``)."""
    outcome = OutcomeRule.parse(opts.outcome)
    with Campaign(opts.campaign, workers=opts.workers, root=opts.root) as campaign:
        collapse = campaign.client.thresholds().collapse
        data = read_back(campaign.client, opts.campaign, runs, outcome)
    tune = [d for d in data if d.run.split == "tune"]
    test = [d for d in data if d.run.split == "test"]
    log(f"choosing the forecast on {len(tune)} tune runs ({len(FORECAST_GRID)} candidates), judging it on {len(test)}")
    shipped = shipped_forecast()
    return {
        "collapse_threshold": collapse,
        "runs": [d.row() for d in data],
        "shipped_forecast": shipped,
        "shipped_on_test": forecast_errors(test, {"shipped": {"rule": shipped}}, collapse),
        "forecast_tuning": forecast_tuning(tune, test, collapse),
    }


def write_report(opts: Options) -> int:
    results = load(opts.results)
    if results is None:
        raise SystemExit(f"no experiments/results/{opts.results}.json: run the suite first")
    study = load(FORECAST_RESULTS)
    if study is not None:
        results = {**results, "forecast_study": study}
    command = f"python -m experiments.instability --runs {opts.runs.relative_to(ROOT.parent) if opts.runs.is_absolute() and opts.runs.is_relative_to(ROOT.parent) else opts.runs}"
    instability_report.write(results, opts.docs or instability_report.DOCS, png=opts.png, command=command)
    return 0


def parse(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(prog="python -m experiments.instability", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="the suite's YAML file")
    p.add_argument("--campaign", default=None, help="collector folder under experiments/out/ (default: the suite's)")
    p.add_argument("--root", type=Path, default=None, help="the campaign's folder (default experiments/out/NAME)")
    p.add_argument("--workers", type=int, default=2, help="trainings at once (one CPU thread each)")
    p.add_argument(
        "--outcome",
        default="delta=0.5,for=5,window=20",
        help="the outcome rule (fixed: see qkwatch/client/outcomes.py)",
    )
    p.add_argument("--train-only", action="store_true", help="train the runs and stop")
    p.add_argument("--report", action="store_true", help="rewrite the page from the committed results only")
    p.add_argument("--results", default="instability", help="experiments/results/NAME.json")
    p.add_argument("--no-png", action="store_true", help="skip the PNG figures (no Chromium)")
    p.add_argument("--docs", type=Path, default=None, help="where instability.md goes (default docs/)")
    p.add_argument(
        "--forecast",
        action="store_true",
        help=f"only the {FORECAST_PRESSURE!r} runs: choose the forecast and judge it "
        f"(experiments/results/{FORECAST_RESULTS}.json), then rewrite the page",
    )
    a = p.parse_args(argv)
    campaign = a.campaign or ("instability_sweep" if a.runs.resolve() == DEFAULT_RUNS.resolve() else "instability")
    return Options(
        a.runs,
        campaign,
        a.root,
        a.workers,
        a.outcome,
        a.train_only,
        a.report,
        a.results,
        a.docs,
        not a.no_png,
        a.forecast,
    )


def sweep_main(opts: Options, runs: Sequence[SuiteRun]) -> int:
    """The sweep: train (resumable), read every step into the npz, score from the committed files, write the page."""
    from experiments import sweep_analysis, yardstick
    from experiments.early_warning import sweep_report

    if not opts.report_only:
        kept = set(instability_data.names(sweep_analysis.data_path()))
        if kept:
            log(f"{len(kept)} runs are in {sweep_analysis.data_path().name} already and are not trained again")
        train(opts, [r for r in runs if r.name not in kept])
        if opts.train_only:
            return 0
        sweep_analysis.export()
    if not sweep_analysis.outcome_path().exists():
        raise SystemExit(
            "the outcome is not fixed yet: python -m experiments.sweep_analysis --fix-outcome, commit, then score"
        )
    results = sweep_analysis.score_sweep()
    save_json(results, sweep_analysis.results_path())
    board = None
    if yardstick.ready():  # issue 40: the held-out recipes, their outcome and the tuning all committed
        board = yardstick.results()
        save_json(board, yardstick.scores_path())
    path = sweep_report.write(results, opts.docs or sweep_report.DOCS, board)
    log(f"wrote {sweep_analysis.results_path()}{' and ' + str(yardstick.scores_path()) if board else ''} and {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    runs = load_runs(opts.runs)
    log(f"{len(runs)} runs in {opts.runs}")
    if opts.runs.resolve() == DEFAULT_RUNS.resolve():
        return sweep_main(opts, runs)
    if opts.report_only:
        return write_report(opts)
    if opts.forecast_only:
        runs = [r for r in runs if r.pressure == FORECAST_PRESSURE]
        log(f"--forecast: the {len(runs)} {FORECAST_PRESSURE!r} runs")
    kept = set(instability_data.names(RESULTS / f"{opts.campaign}_runs.npz"))
    if kept:
        log(f"{len(kept)} runs are in {opts.campaign}_runs.npz already and are not trained again")
    train(opts, [r for r in runs if r.name not in kept])
    if opts.train_only:
        return 0
    if opts.forecast_only:
        path = save(FORECAST_RESULTS, analyse_forecast(opts, runs), strict=True)
        log(f"wrote {path}")
        return write_report(opts)
    results = analyse(opts, runs)
    path = save(opts.results, results, strict=True)
    log(f"wrote {path}")
    return write_report(opts)


if __name__ == "__main__":
    raise SystemExit(main())
