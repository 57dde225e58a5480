"""``qkwatch runs list|show|tag|untag|note|delete``: runs through the collector's REST API.

``list`` prints a plain-text table (``--json`` for programs); ``show`` prints one run, its lambdas and
its open alerts as JSON. A run is named by its id or ``project/name``.
"""

from __future__ import annotations

import argparse
import json
import sys

from qkwatch.commands.connection import client_args, fail, open_client
from qkwatch.commands.errors import one_line_errors
from qkwatch.commands.tables import table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "runs",
        help="list, search, show, tag, annotate or delete runs (through the collector's API)",
        description="Runs through the collector's API. A run is named by its id or project/name.",
    )
    rsub = p.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    ls = rsub.add_parser(
        "list",
        help="runs matching the filters, latest activity first",
        description="Runs matching every filter given, latest activity first: id, project/name, "
        "status, latest attempt, last step, last update (UTC), tags.",
    )
    ls.add_argument("--project", help="only this project")
    ls.add_argument("--status", choices=["running", "finished", "crashed"], help="only runs with this status")
    ls.add_argument("--name", help="only runs with this name")
    ls.add_argument(
        "--tag", action="append", default=[], metavar="TAG", help="only runs with this tag (repeat: runs with all)"
    )
    ls.add_argument(
        "--qkai-above",
        type=float,
        metavar="X",
        help="runs in which some layer's QKAI was above X at some report (any step, any attempt)",
    )
    ls.add_argument(
        "--qkai-latest-above", type=float, metavar="X", help="runs whose latest QKAI of some layer is above X"
    )
    ls.add_argument(
        "--collapse-band",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="runs that have had (--collapse-band) or never had (--no-collapse-band) a collapse band alert",
    )
    ls.add_argument("--alert", metavar="RULE", help="runs that have had an alert of this rule, e.g. qkai_high")
    for when in ("created", "updated"):
        for side, word in (("after", "at or after"), ("before", "at or before")):
            ls.add_argument(
                f"--{when}-{side}",
                metavar="TIME",
                help=f"runs {when} {word} TIME (ISO 8601, UTC unless it has an offset, or epoch seconds)",
            )
    ls.add_argument("--limit", type=int, default=1000, help="at most this many runs (default %(default)s)")
    ls.add_argument("--json", action="store_true", help="print the runs as JSON (epoch and ISO 8601 times)")
    client_args(ls)
    ls.set_defaults(handler=cmd_runs_list)
    show = rsub.add_parser(
        "show",
        help="one run as JSON: the run, its lambdas and its open alerts (firing, or ended with the run while firing)",
    )
    show.add_argument("run", help="run id or project/name")
    client_args(show)
    show.set_defaults(handler=cmd_runs_show)
    for action, verb, what in (("tag", "add", "add tags to a run"), ("untag", "remove", "remove tags from a run")):
        t = rsub.add_parser(
            action,
            help=f"{what} (an ingest or control token)",
            description=f"{what[0].upper()}{what[1:]} and print the tags it has then. A tag is 1-64 letters, "
            "digits and _.:/=- (no space or comma), starting with a letter, digit or _.",
        )
        t.add_argument("run", help="run id or project/name")
        t.add_argument("tags", nargs="+", metavar="TAG", help=f"the tags to {verb}")
        client_args(t)
        t.set_defaults(handler=cmd_runs_tag)
    note = rsub.add_parser(
        "note",
        help="set a run's notes (an ingest or control token)",
        description="Set the run's notes, replacing what they held: free text up to 10 KiB. '-' reads them "
        "from standard input; '' clears them.",
    )
    note.add_argument("run", help="run id or project/name")
    note.add_argument("text", help="the notes; '-': read standard input; '': clear them")
    client_args(note)
    note.set_defaults(handler=cmd_runs_note)
    rm = rsub.add_parser("delete", help="delete a run and all its points (control scope)")
    rm.add_argument("run", help="run id or project/name")
    rm.add_argument("--yes", action="store_true", help="do not ask")
    client_args(rm)
    rm.set_defaults(handler=cmd_runs_delete)


@one_line_errors("runs list")
def cmd_runs_list(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    filters = {
        k: getattr(args, k)
        for k in (
            "qkai_above",
            "qkai_latest_above",
            "collapse_band",
            "alert",
            "created_after",
            "created_before",
            "updated_after",
            "updated_before",
        )
    }
    try:
        with open_client(args) as c:
            runs = c.search_runs(
                args.project, status=args.status, name=args.name, tags=args.tag, max_results=args.limit, **filters
            )
    except CollectorError as exc:
        return fail(exc)
    if args.json:
        print(json.dumps({"data": [r.raw for r in runs], "count": len(runs)}, indent=2))
        return 0
    rows = [
        [
            r.id,
            r.ref,
            r.status,
            str(r.latest_attempt),
            "-" if r.last_step is None else str(r.last_step),
            r.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
            _tag_cell(r.tags),
        ]
        for r in runs
    ]
    print(table(["id", "run", "status", "attempt", "last step", "updated (UTC)", "tags"], rows))
    return 0


def _tag_cell(tags: tuple[str, ...]) -> str:
    """A run's tags in one table cell (a tag holds no comma or space): ``a,b``, or ``-`` for none."""
    return ",".join(tags) or "-"


@one_line_errors("runs")
def cmd_runs_tag(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    try:
        with open_client(args) as c:
            run = c.tag(args.run, *args.tags) if args.runs_command == "tag" else c.untag(args.run, *args.tags)
    except CollectorError as exc:
        return fail(exc)
    print(f"{run.ref}: tags {_tag_cell(run.tags)}")
    return 0


@one_line_errors("runs note")
def cmd_runs_note(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        with open_client(args) as c:
            run = c.update_run(args.run, notes=text)
    except CollectorError as exc:
        return fail(exc)
    said = f"set ({len(run.notes)} characters)" if run.notes else "cleared"
    print(f"{run.ref}: notes {said}")
    return 0


@one_line_errors("runs show")
def cmd_runs_show(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    try:
        with open_client(args) as c:
            run = c.run(args.run)
            # Open: nothing resolved them. An alert still firing when the run ended is "ended", with its last values.
            alerts = [a for state in ("firing", "ended") for a in c.alerts(run=run.id, state=state).raw["data"]]
            print(json.dumps({"run": run.raw, "lambdas": c.lambdas(run.id).raw, "alerts": alerts}, indent=2))
    except CollectorError as exc:
        return fail(exc)
    return 0


@one_line_errors("runs delete")
def cmd_runs_delete(args: argparse.Namespace) -> int:
    from qkwatch.client.rest import CollectorError

    if not args.yes and (not sys.stdin.isatty() or input(f"delete run {args.run} and all its points? [y/N] ") != "y"):
        print("not deleted (pass --yes)", file=sys.stderr)
        return 1
    try:
        with open_client(args) as c:
            c.delete_run(args.run)
    except CollectorError as exc:
        return fail(exc)
    print(f"deleted run {args.run}")
    return 0
