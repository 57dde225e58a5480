"""``qkwatch alerts backtest``: replay stored runs through alert rules (:mod:`qkwatch.client.backtest`)
and print, per run, each rule's first firing, its lead on the run's outcome and over a loss-only
alert, then a summary over the runs with false alarms per healthy run (rich tables; ``--json`` for
programs). ``--reference RUN`` judges each run degraded against its twin.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import TYPE_CHECKING

from qkwatch.commands.connection import client_args, fail, open_client
from qkwatch.commands.errors import one_line_errors

if TYPE_CHECKING:  # for annotations only: the handler imports these when it runs
    from qkwatch.client.backtest import Judging, RunBacktest
    from qkwatch.client.backtest_scores import RuleScore
    from qkwatch.rules.ruleset import RuleSet


SUITE_DELTA = 0.11
"""The instability suite's delta (``qkwatch.client.outcomes.SUITE_DELTA``; a test holds them equal): written
here so that ``--help`` imports nothing heavy."""


class _Tuned:
    """``qkwatch.rules.loss_rules.TUNED_BASELINE``'s text, without importing numpy for ``--help``."""

    @staticmethod
    def text() -> str:
        return "level:at=300,above=2.15"


TUNED_BASELINE = _Tuned()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "backtest",
        help="replay stored runs through alert rules: each rule's first firing and its lead on the run's outcome",
        description="Replay runs stored in the collector through alert rules, with the collector's own "
        "evaluator, and score each rule against the run's outcome read from its loss (diverged, spiked, "
        "healthy, or unknown without a loss) and, with --reference, from where it ended (degraded: its "
        "final held-out loss at least --delta above the reference's): the step it first fired at, its "
        "lead, the outcome's step minus that step (negative: late), and its lead over a loss-only alert "
        "(--loss-alert), the step that alert fired minus that step. A rule that fires on a healthy run "
        "is a false alarm; the summary counts them per healthy run.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run id or project/name; several for a summary over them")
    p.add_argument(
        "--rules",
        metavar="FILE",
        help="alert rules YAML file, as for serve (default: the default rules at the collector's collapse threshold)",
    )
    p.add_argument(
        "--outcome",
        metavar="RULE",
        default="",
        help="how the outcome is read from the loss: delta=X,for=K,window=W (any may be left out; "
        "default: the documented rule, delta=0.5,for=5,window=20)",
    )
    p.add_argument(
        "--reference",
        metavar="RUN",
        help="the twin each run is judged against (same recipe, a setting that went well): a run whose final "
        "held-out loss (mean of its last 3 val_loss values) is at least --delta above the reference's is degraded",
    )
    p.add_argument(
        "--delta",
        type=float,
        default=SUITE_DELTA,
        metavar="NATS",
        help=f"with --reference: nats of final held-out loss that make a run degraded (default {SUITE_DELTA:g}, "
        "the instability suite's fixed value; measure your own recipe's seed spread for another)",
    )
    p.add_argument(
        "--loss-alert",
        metavar="RULE",
        default=TUNED_BASELINE.text(),
        help="the loss-only alert each rule's lead is measured over: level:at=S,above=X | fall:at=S,fraction=F | "
        "rise:rise=X,for_steps=N | plateau:span=N,drop=X,start=S,until=F | slope:span=N,per_100=X,start=S "
        f"(optional window=N), or none (default {TUNED_BASELINE.text()}, the suite's tuned one: a loss level "
        "belongs to its recipe)",
    )
    p.add_argument("--json", action="store_true", help='print {"runs": [...], "summary": [...]} as JSON')
    client_args(p)
    p.set_defaults(handler=cmd_alerts_backtest)


@one_line_errors("alerts backtest")
def cmd_alerts_backtest(args: argparse.Namespace) -> int:
    from qkwatch.client import backtest, backtest_scores, run_history
    from qkwatch.client.outcomes import OutcomeRule
    from qkwatch.client.rest import CollectorError
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
    from qkwatch.rules.loss_rules import LossRule

    try:
        outcome_rule = OutcomeRule.parse(args.outcome)
    except ValueError as exc:
        print(f"qkwatch alerts backtest: --outcome: {exc}", file=sys.stderr)
        return 2
    try:
        loss_alert = None if args.loss_alert.strip().lower() == "none" else LossRule.parse(args.loss_alert)
        judging = backtest.Judging(outcome_rule, delta=args.delta, loss_alert=loss_alert)
    except ValueError as exc:
        flag = "--delta" if "delta" in str(exc) else "--loss-alert"
        print(f"qkwatch alerts backtest: {flag}: {exc}", file=sys.stderr)
        return 2
    try:  # checked before the collector is asked anything: a bad file is the user's to fix first
        _backtest_rules(args.rules, COLLAPSE_THRESHOLD)
    except ValueError as exc:
        print(f"qkwatch alerts backtest: rules file {args.rules}: {exc}", file=sys.stderr)
        return 2
    try:
        with open_client(args) as c:
            collapse = c.collapse_threshold()
            try:
                rules = _backtest_rules(args.rules, collapse)
            except ValueError as exc:
                print(f"qkwatch alerts backtest: rules file {args.rules}: {exc}", file=sys.stderr)
                return 2
            histories = [run_history.read(c, run) for run in args.runs]
            if args.reference:
                judging = dataclasses.replace(judging, reference=run_history.read(c, args.reference))
                if not math.isfinite(judging.reference_final() or math.inf):
                    print(
                        f"qkwatch alerts backtest: --reference {args.reference}: no finite val_loss logged "
                        "(the degraded outcome compares final held-out losses)",
                        file=sys.stderr,
                    )
                    return 2
    except CollectorError as exc:
        return fail(exc)
    results = [backtest.backtest(h, rules, judging=judging) for h in histories]
    summary = backtest_scores.summarize(results)
    how = _judged_how(judging)
    if args.json:
        body = {
            "runs": [r.to_json() for r in results],
            "summary": [s.to_json() for s in summary],
            "rules": args.rules or "default",
            "collapse_threshold": collapse,
            "outcome_rule": outcome_rule.describe(),
            "reference": judging.reference.run if judging.reference else None,
            "reference_final": judging.reference_final(),
            "delta": judging.delta,
            "loss_alert": loss_alert.text() if loss_alert else None,
            "judged": how,
        }
        print(json.dumps(body, indent=2))
        return 0
    _print_backtest(results, summary, how)
    return 0


def _judged_how(judging: Judging) -> str:
    """One line on how the runs were judged and what the leads are measured over."""
    parts = [f"outcome rule {judging.outcome_rule.describe()}"]
    if judging.reference is not None:
        parts.append(
            f"degraded: final held-out loss >= {judging.reference.run}'s {judging.reference_final():.3f} "
            f"+ {judging.delta:g}"
        )
    if judging.loss_alert is not None:
        parts.append(f"loss-only alert {judging.loss_alert.text()}")
    return "; ".join(parts)


def _backtest_rules(path: str | None, collapse: float) -> RuleSet:
    from pathlib import Path

    from qkwatch.rules.ruleset import RuleSet

    return RuleSet.from_file(Path(path), collapse) if path else RuleSet.default(collapse)


def _print_backtest(results: list[RunBacktest], summary: list[RuleScore], judged: str) -> None:
    """One table per run (a rule per row), then the rules over all runs when there are several."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if sys.stdout.isatty() else 120)  # piped: wide enough for every column
    for run in results:
        at = f" at step {run.outcome_step}" if run.outcome_step is not None else ""
        alarm = "  [bold red]false alarm[/]" if run.false_alarm else ""
        table = Table(
            box=None,
            header_style="bold",
            pad_edge=False,
            title=f"{run.run}: {run.outcome}{at}{alarm}",
            caption=f"{run.why} ({run.reports} reports; {judged}). lead: outcome step - fired, in steps and "
            "reports; vs loss: the loss-only alert's step - fired",
            title_justify="left",
            caption_justify="left",
        )
        for name in ("rule", "fired", "onset", "layers", "lead", "reports", "vs loss", "alerts"):
            table.add_column(name, justify="left" if name in ("rule", "layers") else "right", no_wrap=True)
        for r in run.rules:
            table.add_row(
                r.rule,
                _cell(r.first_fire_step),
                _cell(r.onset_step),
                ",".join(map(str, r.layers)) or "-",
                _lead(r.lead_steps),
                _lead(r.lead_reports),
                _lead(r.lead_vs_loss),
                str(r.firings),
                style="red" if run.outcome == "healthy" and r.firings else None,
            )
        out.print(table)
        out.print()
    if len(results) < 2:
        return
    table = Table(
        box=None,
        header_style="bold",
        pad_edge=False,
        title="over all runs",
        title_justify="left",
        caption="recall = early / bad: bad runs flagged before their outcome; alarms: healthy runs it fired on, "
        "of the healthy ones; lead, reports: the median lead of the early ones, in steps and in reports; "
        "vs loss: their median lead over the loss-only alert",
        caption_justify="left",
    )
    for name in ("rule", "recall", "early", "late", "bad", "alarms", "lead", "reports", "vs loss"):
        table.add_column(name, justify="left" if name == "rule" else "right", no_wrap=True)
    for s in summary:
        table.add_row(
            s.rule,
            "-" if s.recall is None else f"{s.recall:.0%}",
            str(s.flagged),
            str(s.late),
            str(s.bad_runs),
            f"{s.false_alarms}/{s.healthy_runs}",
            "-" if s.median_lead_steps is None else f"{s.median_lead_steps:g}",
            "-" if s.median_lead_reports is None else f"{s.median_lead_reports:g}",
            "-" if s.median_lead_vs_loss is None else f"{s.median_lead_vs_loss:g}",
        )
    out.print(table)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _lead(value: int | None) -> str:
    if value is None:
        return "-"
    return f"[green]{value}[/]" if value > 0 else f"[yellow]{value}[/]"
