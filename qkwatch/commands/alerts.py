"""``qkwatch alerts``: the alerts a token may see, as a plain-text table or JSON, through the collector's
REST API. An alert still firing when its run ended reads "run ended while firing", never "resolved".
``alerts backtest`` is :mod:`qkwatch.commands.backtest`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from qkwatch.commands.backtest import register as register_backtest
from qkwatch.commands.connection import client_args, fail, open_client
from qkwatch.commands.errors import one_line_errors
from qkwatch.commands.tables import table
from qkwatch.contract.api import ALERT_STATE_TEXT


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "alerts",
        help="list alerts, or backtest alert rules on stored runs (through the collector's API)",
        description="Alerts the token may see, newest first: state, severity, run, rule, layers, onset step, "
        "end, last values and summary. An alert still firing when its run ended (finished, crashed or stale) "
        "is 'run ended while firing', never resolved, with the run's last step and the metric's last values. "
        "'qkwatch alerts backtest RUN...' replays stored runs through alert rules.",
    )
    p.add_argument("--run", help="only this run (id or project/name)")
    p.add_argument(
        "--state",
        choices=["firing", "resolved", "ended"],
        help="only firing, resolved, or ended alerts (ended: the run ended while the alert fired)",
    )
    p.add_argument("--json", action="store_true", help="print the alerts as JSON (epoch and ISO 8601 times)")
    client_args(p)
    p.set_defaults(handler=cmd_alerts)
    asub = p.add_subparsers(dest="alerts_command", metavar="ACTION")  # optional: plain `alerts` lists them
    register_backtest(asub)


@one_line_errors("alerts")
def cmd_alerts(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    try:
        with open_client(args) as c:
            alerts = c.alerts(run=args.run, state=args.state)
    except CollectorError as exc:
        return fail(exc)
    if args.json:
        print(json.dumps(alerts.raw, indent=2))
        return 0
    headers = ["state", "severity", "run", "rule", "layers", "onset step", "end", "last values", "summary"]
    print(table(headers, [_alert_row(a) for a in alerts.raw["data"]]))
    return 0


def _alert_row(a: dict[str, Any]) -> list[str]:
    """One alert as table cells (``a`` as the API sends it)."""
    if a["state"] == "resolved":
        end = f"resolved at step {a['resolved_step']}"
    elif a["state"] == "ended":
        at = "" if a.get("ended_step") is None else f" at step {a['ended_step']}"
        end = f"run {a.get('run_end') or 'ended'}{at}"
    else:
        end = "-"
    last = a.get("last_values")
    values = ", ".join(f"{layer}: {_value(v)}" for layer, v in zip(a["layers"], last, strict=False)) if last else "-"
    return [
        ALERT_STATE_TEXT.get(a["state"], a["state"]),  # an ended alert is never shown as resolved
        a["severity"],
        f"{a['project']}/{a['run_name']}",
        a["rule"],
        ",".join(map(str, a["layers"])),
        str(a["onset_step"]),
        end,
        values,
        a["summary"],
    ]


def _value(v: float | str | None) -> str:
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v:.4g}"
