"""``qkwatch alerts backtest``: replay stored runs through alert rules (:mod:`qkwatch.monitor.backtest`)
and print, per run, each rule's first firing and its lead on the run's outcome, then a summary over
the runs (rich tables; ``--json`` for programs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from qkwatch.monitor.cli.connection import client_args, fail, open_client
from qkwatch.monitor.cli.errors import one_line_errors

if TYPE_CHECKING:  # for annotations only: the handler imports these when it runs
    from qkwatch.monitor.alerting.ruleset import RuleSet
    from qkwatch.monitor.backtest import RuleScore, RunBacktest


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "backtest",
        help="replay stored runs through alert rules: each rule's first firing and its lead on the run's outcome",
        description="Replay runs stored in the collector through alert rules, with the collector's own "
        "evaluator, and score each rule against the run's outcome read from its loss (diverged, spiked, "
        "healthy, or unknown without a loss): the step it first fired at, and its lead, the outcome's "
        "step minus that step (negative: late). A rule that fires on a healthy run is a false alarm.",
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
    p.add_argument("--json", action="store_true", help='print {"runs": [...], "summary": [...]} as JSON')
    client_args(p)
    p.set_defaults(handler=cmd_alerts_backtest)


@one_line_errors("alerts backtest")
def cmd_alerts_backtest(args: argparse.Namespace) -> int:
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
    from qkwatch.monitor import backtest
    from qkwatch.monitor.client import CollectorError
    from qkwatch.monitor.outcomes import OutcomeRule

    try:
        outcome_rule = OutcomeRule.parse(args.outcome)
    except ValueError as exc:
        print(f"qkwatch alerts backtest: --outcome: {exc}", file=sys.stderr)
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
            histories = [backtest.read(c, run) for run in args.runs]
    except CollectorError as exc:
        return fail(exc)
    results = [backtest.backtest(h, rules, outcome_rule) for h in histories]
    summary = backtest.summarize(results)
    if args.json:
        body = {
            "runs": [r.to_json() for r in results],
            "summary": [s.to_json() for s in summary],
            "rules": args.rules or "default",
            "collapse_threshold": collapse,
            "outcome_rule": outcome_rule.describe(),
        }
        print(json.dumps(body, indent=2))
        return 0
    _print_backtest(results, summary, outcome_rule.describe())
    return 0


def _backtest_rules(path: str | None, collapse: float) -> RuleSet:
    from pathlib import Path

    from qkwatch.monitor.alerting.ruleset import RuleSet

    return RuleSet.from_file(Path(path), collapse) if path else RuleSet.default(collapse)


def _print_backtest(results: list[RunBacktest], summary: list[RuleScore], outcome_rule: str) -> None:
    """One table per run (a rule per row), then the rules over all runs when there are several."""
    from rich.console import Console
    from rich.table import Table

    out = Console()
    for run in results:
        at = f" at step {run.outcome_step}" if run.outcome_step is not None else ""
        alarm = "  [bold red]false alarm[/]" if run.false_alarm else ""
        table = Table(
            box=None,
            header_style="bold",
            pad_edge=False,
            title=f"{run.run}: {run.outcome}{at}{alarm}",
            caption=f"{run.why} ({run.reports} reports; outcome rule {outcome_rule})",
            title_justify="left",
            caption_justify="left",
        )
        for name in ("rule", "first fired", "onset", "layers", "lead (steps)", "lead (reports)", "alerts"):
            table.add_column(name, justify="left" if name in ("rule", "layers") else "right", no_wrap=True)
        for r in run.rules:
            table.add_row(
                r.rule,
                _cell(r.first_fire_step),
                _cell(r.onset_step),
                ",".join(map(str, r.layers)) or "-",
                _lead(r.lead_steps),
                _lead(r.lead_reports),
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
        caption="recall = early / bad: bad runs flagged before their outcome; alarms: healthy runs it fired on; "
        "lead, reports: the median lead of the early ones, in steps and in reports",
        caption_justify="left",
    )
    for name in ("rule", "recall", "early", "late", "bad", "alarms", "healthy", "lead", "reports"):
        table.add_column(name, justify="left" if name == "rule" else "right", no_wrap=True)
    for s in summary:
        table.add_row(
            s.rule,
            "-" if s.recall is None else f"{s.recall:.0%}",
            str(s.flagged),
            str(s.late),
            str(s.bad_runs),
            str(s.false_alarms),
            str(s.healthy_runs),
            "-" if s.median_lead_steps is None else f"{s.median_lead_steps:g}",
            "-" if s.median_lead_reports is None else f"{s.median_lead_reports:g}",
        )
    out.print(table)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _lead(value: int | None) -> str:
    if value is None:
        return "-"
    return f"[green]{value}[/]" if value > 0 else f"[yellow]{value}[/]"
