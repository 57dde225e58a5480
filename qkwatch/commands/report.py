"""``qkwatch report``: write one self-contained HTML report of a run (and optionally a second one beside
it), read from a collector or, with ``--spool DIR``, from the run's spool on disk; the report itself is
:mod:`qkwatch.client.report`.
"""

from __future__ import annotations

import argparse
import os
import sys

from qkwatch.commands.connection import check_endpoint
from qkwatch.commands.errors import one_line_errors


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML report of a run (opens with no network)")
    p.add_argument("run", nargs="?", default=None, help="run id or project/name (on the collector)")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument(
        "--spool",
        default=None,
        metavar="DIR",
        help="read the run from its spool on disk instead, with no collector (a rank's spool or the run's folder)",
    )
    p.add_argument("--vs", default=None, metavar="RUN2", help="a second run to compare with, side by side")
    p.add_argument("--url", default=None, help="collector URL (default: $QKWATCH_URL)")
    p.add_argument("--token", default=None, help="read token (default: $QKWATCH_TOKEN)")
    p.set_defaults(handler=cmd_report)


@one_line_errors("report")
def cmd_report(args: argparse.Namespace) -> int:
    from qkwatch.client.report import write_report, write_spool_report
    from qkwatch.client.report_data import ReportError

    if args.spool is not None:
        if args.run is not None or args.vs is not None:
            print("qkwatch report: --spool reads one run from disk; give no RUN and no --vs with it", file=sys.stderr)
            return 2
        try:
            out = write_spool_report(args.spool, args.out)
        except (ReportError, OSError) as exc:
            print(f"qkwatch report: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {out}")
        return 0
    if args.run is None:
        print("qkwatch report: give a RUN (id or project/name) on the collector, or --spool DIR", file=sys.stderr)
        return 2
    check_endpoint(args.url or os.environ.get("QKWATCH_URL"), args.token or os.environ.get("QKWATCH_TOKEN"))
    try:
        out = write_report(args.run, args.out, vs=args.vs, url=args.url, token=args.token)
    except (ReportError, OSError) as exc:
        print(f"qkwatch report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
