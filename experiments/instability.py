"""``python -m experiments.instability``: trouble qkwatch did not make, and how early its alerts see it.

The suite trains the runs of a YAML file (``experiments/instability_runs.yml`` by default: a
learning-rate sweep in the style of Wortsman et al. 2023 over vanilla, qk_norm, sigma_reparam and
RAA; the key contraction alone, *induced*; no warmup at a high rate; healthy controls) into one
collector, through the agent, and reads every run back over REST. Then:

1. every run gets its outcome from its logged loss alone (``qkwatch.monitor.outcomes``: the rule
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
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments import instability_data, instability_report
from experiments.common import RESULTS, ROOT, Campaign, load, log, save
from experiments.suite import SuiteRun, load_runs
from qkwatch.monitor import backtest
from qkwatch.monitor.alerting.ruleset import RuleSet
from qkwatch.monitor.backtest import RuleScore, summarize
from qkwatch.monitor.client import Client
from qkwatch.monitor.outcomes import Outcome, OutcomeRule, label
from qkwatch.monitor.run_history import RunHistory, read

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


# --- reading back -------------------------------------------------------------------------------------


@dataclass
class RunData:
    """One run as the collector holds it, with what the scoreboard needs of it."""

    run: SuiteRun
    history: RunHistory
    outcome: Outcome
    init_loss: float
    final_loss: float
    """Mean of the last ten logged training losses (NaN when they are not finite)."""
    val_loss: float | None
    """The last validation loss, None when none was logged (a run that stopped early)."""
    peaks: dict[str, float]
    """Per metric, the largest (``stable_rank``, ``attn_entropy``: also smallest) value over layers and reports."""

    def row(self) -> dict[str, Any]:
        r = self.run
        return {
            "name": r.name,
            "split": r.split,
            "pressure": r.pressure,
            "variant": r.variant,
            "lr": r.lr,
            "seed": r.seed,
            "induced": r.induced,
            "outcome": self.outcome.label,
            "outcome_step": self.outcome.step,
            "why": self.outcome.why,
            "init_loss": self.init_loss,
            "final_loss": self.final_loss,
            "val_loss": self.val_loss,
            "reports": len({x.step for x in self.history.reports}),
            "loss_steps": len(self.history.losses),
            "peaks": self.peaks,
            "loss_curve": _curve(self.history.loss_steps, self.history.losses),
            "reports_before_outcome": self.reports_before_outcome(),
        }

    def reports_before_outcome(self) -> int | None:
        """Reports at steps before the outcome's (None for a healthy run)."""
        if self.outcome.step is None:
            return None
        return sum(1 for step in {x.step for x in self.history.reports} if step < self.outcome.step)


def _curve(steps: Sequence[int], values: Sequence[float], points: int = 100) -> list[list[float]]:
    """At most ``points`` (step, value) pairs, evenly spaced, for the figures (NaN as None in JSON)."""
    stride = max(1, math.ceil(len(steps) / points))
    return [[s, v] for s, v in list(zip(steps, values, strict=True))[::stride]]


def read_back(client: Client, campaign: str, runs: Sequence[SuiteRun], outcome: OutcomeRule) -> list[RunData]:
    out = []
    for r in runs:
        history = read(client, f"{campaign}/{r.name}")
        if not history.losses:
            raise RuntimeError(f"{r.name}: no loss was logged; the suite needs every run's loss")
        val = client.series(f"{campaign}/{r.name}", "val_loss").values
        finite_val = [v for v in val if v is not None and math.isfinite(v)]
        tail = history.losses[-10:]
        out.append(
            RunData(
                r,
                history,
                label(history.loss_steps, history.losses, outcome),
                history.losses[0],
                statistics.fmean(tail) if all(math.isfinite(x) for x in tail) else math.nan,
                finite_val[-1] if finite_val else None,
                _peaks(history),
            )
        )
    return out


def _peaks(history: RunHistory) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for report in history.reports:
        for metric, layers in report.layers.items():
            values.setdefault(metric, []).extend(v for v in layers if v is not None and math.isfinite(v))
    out = {f"{m}_max": max(v) for m, v in values.items() if v}
    out |= {f"{m}_min": min(v) for m, v in values.items() if v and m in ("stable_rank", "attn_entropy")}
    return out


# --- detectors: chosen on tune, scored on test -----------------------------------------------------------

FIXED: list[dict[str, Any]] = [
    {"name": "qkai_high", "metric": "qkai", "op": ">", "for_reports": 3},
    {"name": "collapse_band", "band_of": "qkai_high", "min_layers": 3, "severity": "critical"},
]
"""The user's collapse rules: kept as they are, never tuned."""

FAMILIES: dict[str, list[dict[str, Any]]] = {
    "logit_growth": [
        {
            "kind": "growth",
            "metric": "logit_max",
            "factor": f,
            "baseline_reports": 5,
            "skip_reports": 1,
            "for_reports": n,
        }
        for f in (1.5, 2.0, 3.0, 5.0)
        for n in (2, 3)
    ],
    "attn_one_hot": [
        {"metric": "attn_entropy", "op": "<", "threshold": x, "for_reports": 3} for x in (0.05, 0.1, 0.2, 0.3)
    ],
    "attn_uniform": [
        {"metric": "attn_entropy", "op": ">", "threshold": x, "for_reports": 3} for x in (0.95, 0.97, 0.98, 0.99)
    ],
    "stable_rank_low": [
        {"metric": "stable_rank", "op": "<", "threshold": x, "for_reports": 3} for x in (1.1, 1.2, 1.3, 1.5)
    ],
    "qkai_forecast": [
        {"kind": "forecast", "metric": "qkai", "op": ">", "window": w, "horizon_steps": h, "for_reports": n}
        for w in (6, 10)
        for h in (100, 250, 500)
        for n in (1, 2)
    ],
    "stable_rank_forecast": [
        {
            "kind": "forecast",
            "metric": "stable_rank",
            "op": "<",
            "threshold": x,
            "window": w,
            "horizon_steps": h,
            "for_reports": 2,
        }
        for x in (1.2, 1.5)
        for w in (6, 10)
        for h in (100, 250)
    ],
}
"""Each detector family's candidate parameters, in order from the most conservative; the first
candidate with the best tune score wins a tie."""


def ruleset(rules: Sequence[dict[str, Any]], collapse: float) -> RuleSet:
    return RuleSet.from_mapping({"rules": list(rules)}, collapse)


def score(data: Sequence[RunData], rules: RuleSet, outcome: OutcomeRule) -> list[RuleScore]:
    return summarize([backtest.backtest(d.history, rules, judging=_spikes_only(outcome)) for d in data])


def _spikes_only(outcome: OutcomeRule) -> backtest.Judging:
    """The earlier suite's judging: spikes and divergence from the loss, no reference, no loss-only row."""
    return backtest.Judging(outcome, loss_alert=None)


def choose(tune: Sequence[RunData], collapse: float, outcome: OutcomeRule) -> dict[str, dict[str, Any]]:
    """Per family, the candidate flagging most bad tune runs before their outcome with no healthy
    tune run fired on; ties go to the longer median lead in reports, then to the earlier candidate.
    A family whose every candidate fires on a healthy tune run, or that flags nothing, is not chosen.
    """
    chosen = {}
    for family, candidates in FAMILIES.items():
        best: tuple[tuple[float, float], dict[str, Any], RuleScore] | None = None
        for params in candidates:
            rule = {"name": family, **params}
            (s, _) = score(tune, ruleset([rule], collapse), outcome)
            key = (float(s.flagged), s.median_lead_reports or 0.0)
            if s.false_alarms == 0 and s.flagged > 0 and (best is None or key > best[0]):
                best = (key, rule, s)
        if best is not None:
            chosen[family] = {"rule": best[1], "tune": best[2].to_json()}
        log(
            f"  {family}: {'chose ' + str(best[1]) if best else 'nothing chosen (no candidate flags a bad tune run without a false alarm)'}"
        )
    return chosen


def detector_table(
    data: Sequence[RunData], chosen: dict[str, dict[str, Any]], collapse: float, outcome: OutcomeRule
) -> dict[str, Any]:
    """The default rules (the user's, plus every chosen family) over ``data``: per rule and any rule."""
    rules = ruleset([*FIXED, *(c["rule"] for c in chosen.values())], collapse)
    results = [backtest.backtest(d.history, rules, judging=_spikes_only(outcome)) for d in data]
    return {
        "scores": [s.to_json() for s in summarize(results)],
        "runs": [r.to_json() for r in results],
    }


# --- forecasts, learning-rate sensitivity, the contraction band ------------------------------------------


DETECTORS = Path(__file__).resolve().parents[1] / "qkwatch" / "dashboards" / "rules" / "detectors.yml"
"""The candidate detectors' rules file, whose qkai_forecast is the forecast users are given."""


def shipped_forecast(path: Path = DETECTORS) -> dict[str, Any]:
    """The qkai_forecast rule of ``qkwatch/dashboards/rules/detectors.yml`` as the file holds it now: its crossing
    error is measured beside the candidates, whether or not tuning chose it."""
    rules = yaml.safe_load(path.read_text())["rules"]
    (rule,) = [r for r in rules if r["name"] == "qkai_forecast"]
    return {k: v for k, v in rule.items() if k != "severity"}


def forecast_errors(
    data: Sequence[RunData], chosen: dict[str, dict[str, Any]], collapse: float
) -> list[dict[str, Any]]:
    """Each forecast alert's predicted crossing step against the step its layer really crossed.

    The error is relative to the time the forecast looked ahead: ``|predicted - actual| / (actual -
    fired)``. A forecast whose layer never crossed by the end of the run is listed without an error.
    """
    out = []
    forecasts = list(
        {
            json.dumps(c["rule"], sort_keys=True): c["rule"]
            for c in chosen.values()
            if c["rule"].get("kind") == "forecast"
        }.values()
    )
    for rule in forecasts:
        rs = ruleset([rule], collapse)
        spec = rs.forecasts[0]
        for d in data:
            for firing in backtest.replay(rs, d.history.reports):
                if firing.predicted_step is None:
                    continue
                (layer,) = firing.layers
                actual = _crossing(d.history, spec.metric, spec.op, spec.threshold, layer, firing.step)
                error = None if actual is None else abs(firing.predicted_step - actual) / max(actual - firing.step, 1)
                out.append(
                    {
                        "run": d.run.name,
                        "rule": rule["name"],
                        "layer": layer,
                        "fired": firing.step,
                        "predicted": firing.predicted_step,
                        "actual": actual,
                        "relative_error": error,
                    }
                )
    return out


FORECAST_GRID: list[dict[str, Any]] = [
    {
        "name": "qkai_forecast",
        "kind": "forecast",
        "metric": "qkai",
        "op": ">",
        "fit": fit,
        "window": w,
        "horizon_steps": h,
        "for_reports": n,
        "margin": m,
    }
    for fit in ("least_squares", "theil_sen")
    for w in (6, 10, 16, 24, 32)
    for h in (100, 250, 500)
    for n in (1, 2, 3)
    for m in (0.0, 1.0)
]
"""The QKAI forecasts tried for their crossing error (forecast_tuning): the line's fit, its window in
reports, the horizon, the reports running and the margin in residual standard deviations."""

FORECAST_MIN_LEAD_STEPS = 25
"""A forecast candidate must look at least this far ahead (median over its forecasts that crossed, on
tune): 5 reports of the collapse runs. A forecast made a report before the crossing is right and useless."""


def forecast_tuning(tune: Sequence[RunData], test: Sequence[RunData], collapse: float) -> dict[str, Any]:
    """The QKAI forecast chosen for its crossing error on the induced tune runs, then judged on test.

    Only induced runs cross the collapse threshold here, so the forecast's error can only be measured
    on them. Fixed before any candidate was scored on the runs of this rule: a candidate of
    :data:`FORECAST_GRID` is eligible when, on every tune run, at least one of its forecasts crossed,
    and the median lead (actual crossing - step it fired) of those is at least
    :data:`FORECAST_MIN_LEAD_STEPS`; the eligible one with the lowest median relative error on tune
    is chosen (ties: the longer median lead, then the grid's order), and only then is its error on
    the test runs computed.
    """
    scored = []
    for rule in FORECAST_GRID:
        rows = forecast_errors(tune, {"c": {"rule": rule}}, collapse)
        crossed = [x for x in rows if x["relative_error"] is not None]
        leads = [x["actual"] - x["fired"] for x in crossed]
        every_run = {x["run"] for x in crossed} == {d.run.name for d in tune}
        lead = statistics.median(leads) if leads else None
        eligible = bool(tune) and every_run and lead is not None and lead >= FORECAST_MIN_LEAD_STEPS
        scored.append(
            {
                "rule": rule,
                "tune_forecasts": len(rows),
                "tune_crossed": len(crossed),
                "tune_median_lead_steps": lead,
                "tune_median": statistics.median(x["relative_error"] for x in crossed) if crossed else None,
                "eligible": eligible,
            }
        )
    eligible = [c for c in scored if c["eligible"]]
    if not eligible:
        return {"candidates": scored, "chosen": None, "test": [], "min_lead_steps": FORECAST_MIN_LEAD_STEPS}
    best = min(enumerate(eligible), key=lambda ic: (ic[1]["tune_median"], -ic[1]["tune_median_lead_steps"], ic[0]))[1]
    test_rows = forecast_errors(test, {"c": {"rule": best["rule"]}}, collapse)
    crossed = [x for x in test_rows if x["relative_error"] is not None]
    return {
        "candidates": scored,
        "min_lead_steps": FORECAST_MIN_LEAD_STEPS,
        "tune_runs": [d.run.name for d in tune],
        "test_runs": [d.run.name for d in test],
        "chosen": best["rule"],
        "tune_median": best["tune_median"],
        "tune_median_lead_steps": best["tune_median_lead_steps"],
        "test": test_rows,
        "test_median": statistics.median(x["relative_error"] for x in crossed) if crossed else None,
        "test_median_lead_steps": statistics.median(x["actual"] - x["fired"] for x in crossed) if crossed else None,
    }


def _crossing(history: RunHistory, metric: str, op: str, threshold: float, layer: int, after: int) -> int | None:
    past = {
        ">": lambda v: v > threshold,
        ">=": lambda v: v >= threshold,
        "<": lambda v: v < threshold,
        "<=": lambda v: v <= threshold,
    }[op]
    for report in sorted(history.reports, key=lambda r: r.step):
        values = report.layers.get(metric) or []
        if report.step > after and layer < len(values) and values[layer] is not None and past(values[layer]):
            return report.step
    return None


def lr_sensitivity(data: Sequence[RunData]) -> dict[str, Any]:
    """Wortsman et al.'s LR sensitivity per variant: the mean over the swept rates of
    ``min(loss, loss at init) - best loss``, from each run's last validation loss (the loss at init
    where a run has none or it is not finite), per seed, then the mean over seeds."""
    sweep = [d for d in data if d.run.pressure == "learning rate" and d.run.lr is not None]
    out: dict[str, Any] = {}
    for variant in sorted({d.run.variant for d in sweep}):
        per_seed = []
        curve: dict[float, list[float]] = {}
        for seed in sorted({d.run.seed for d in sweep}):
            runs = [d for d in sweep if d.run.variant == variant and d.run.seed == seed]
            losses = [min(_loss(d), d.init_loss) for d in runs]
            for d, x in zip(runs, losses, strict=True):
                curve.setdefault(float(d.run.lr or 0), []).append(x)
            per_seed.append(statistics.fmean(x - min(losses) for x in losses))
        out[variant] = {
            "sensitivity": statistics.fmean(per_seed),
            "per_seed": per_seed,
            "curve": {lr: statistics.fmean(v) for lr, v in sorted(curve.items())},
        }
    return out


def _loss(d: RunData) -> float:
    if d.val_loss is not None and math.isfinite(d.val_loss):
        return d.val_loss
    return d.final_loss if math.isfinite(d.final_loss) else d.init_loss


BAND = (3, 4, 5)
"""collapse_cpu's intervention layers."""


def contraction(data: Sequence[RunData]) -> list[dict[str, Any]]:
    """The key-contraction runs (induced): per metric, the band's and the other layers' mean at the last
    report that measured it (the report at close may hold only the applied lambdas), and the band's
    lowest stable rank over the run."""
    out = []
    for d in data:
        if d.run.pressure != "key contraction":
            continue
        reports = sorted(d.history.reports, key=lambda r: r.step)
        row: dict[str, Any] = {
            "run": d.run.name,
            "variant": d.run.variant,
            "split": d.run.split,
            "step": reports[-1].step,
            "val_loss": d.val_loss,
            "outcome": d.outcome.label,
        }
        for metric in ("qkai", "stable_rank", "attn_entropy", "par", "lambda"):
            last = next((r for r in reversed(reports) if r.layers.get(metric)), None)
            values = (last.layers.get(metric) or []) if last else []
            band = [v for i, v in enumerate(values) if i in BAND and v is not None]
            rest = [v for i, v in enumerate(values) if i not in BAND and v is not None]
            row[metric] = {
                "band": statistics.fmean(band) if band else None,
                "rest": statistics.fmean(rest) if rest else None,
                "step": last.step if last else None,
            }
        low = [
            v for r in reports for i, v in enumerate(r.layers.get("stable_rank") or []) if i in BAND and v is not None
        ]
        row["band_stable_rank_min"] = min(low) if low else None
        par = [v for r in reports for i, v in enumerate(r.layers.get("par") or []) if i in BAND and v is not None]
        row["band_par_max"] = max(par) if par else None
        out.append(row)
    return out


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
        help="the outcome rule (fixed: see qkwatch/monitor/outcomes.py)",
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
    from experiments import sweep_analysis, sweep_report, yardstick

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
    sweep_analysis.save_json(results, sweep_analysis.results_path())
    board = None
    if yardstick.ready():  # issue 40: the held-out recipes, their outcome and the tuning all committed
        board = yardstick.results()
        yardstick.save_json(board, yardstick.scores_path())
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
