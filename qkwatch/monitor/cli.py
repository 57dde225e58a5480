"""The collector's subcommands: ``serve``, ``token``, ``db``, ``runs``, ``alerts`` (and ``alerts backtest``).

Only argparse at import time (``qkwatch --help`` stays fast); everything else is imported inside
the handlers.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qkwatch.monitor import dashboards

if TYPE_CHECKING:  # for annotations only: the handlers import these when they run
    from sqlalchemy.engine import Engine

    from qkwatch.monitor.alerting.rules import RuleSet
    from qkwatch.monitor.backtest import RuleScore, RunBacktest
    from qkwatch.monitor.client import Client
    from qkwatch.monitor.settings import Settings
    from qkwatch.monitor.store.store import Store

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _serve(subparsers)
    _token(subparsers)
    _db(subparsers)
    _runs(subparsers)
    _alerts(subparsers)
    _report(subparsers)
    dashboards.register(subparsers)


def _database_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url", default=None, help="SQLAlchemy URL (default: $QKWATCH_DATABASE_URL or sqlite:///qkwatch.db)"
    )


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("QKWATCH_URL", DEFAULT_URL),
        help="collector URL (default: $QKWATCH_URL or %(default)s)",
    )
    p.add_argument("--token", default=os.environ.get("QKWATCH_TOKEN"), help="bearer token (default: $QKWATCH_TOKEN)")


def _serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the collector (migrates the database first)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default %(default)s; 0.0.0.0 for all, which needs tokens)",
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    _database_arg(p)
    p.add_argument("--open", action="store_true", help="no authentication (loopback hosts only; a local demo)")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    p.add_argument("--rules", default=None, help="alert rules YAML file (default: $QKWATCH_ALERT_RULES_FILE)")
    p.set_defaults(handler=cmd_serve)


def is_loopback(host: str) -> bool:
    """True when ``host`` only listens on the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


class StartupError(Exception):
    """What stops a command before it does its work (a bad flag, setting, port or database), as one line
    for the operator; the command prints it after its name and exits with status 2."""


Handler = Callable[[argparse.Namespace], int]


def one_line_errors(command: str) -> Callable[[Handler], Handler]:
    """A handler that prints a :class:`StartupError` as ``qkwatch COMMAND: message`` and returns 2."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except StartupError as exc:
                print(f"qkwatch {command}: {exc}", file=sys.stderr)
                return 2

        return run

    return decorate


@one_line_errors("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    _check_listen_args(args)
    _quiet_alembic()
    settings = _checked_settings(args)
    _check_can_listen(args.host, args.port)
    _prepare_database(settings, _database_source(args))
    import uvicorn

    if settings.open_access:
        logger.warning(
            "!!! AUTHENTICATION IS OFF (--open or QKWATCH_OPEN_ACCESS): anyone who can reach %s:%d can "
            "read, write and steer runs. For a local demo only. !!!",
            args.host,
            args.port,
        )
    print(
        f"qkwatch collector listening on http://{_url_host(args.host)}:{args.port} "
        f"(database {_redact(settings.database_url)})",
        flush=True,
    )
    if args.workers > 1:
        # Workers import the app themselves and read their settings from the environment.
        os.environ.update(
            {"QKWATCH_DATABASE_URL": settings.database_url, "QKWATCH_OPEN_ACCESS": str(settings.open_access).lower()}
        )
        if settings.alert_rules_file:
            os.environ["QKWATCH_ALERT_RULES_FILE"] = str(settings.alert_rules_file)
        uvicorn.run(
            "qkwatch.monitor.main:app_from_env",
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level="info",
        )
        return 0
    from qkwatch.monitor.main import create_app

    uvicorn.run(
        create_app(settings.model_copy(update={"auto_migrate": False})),
        host=args.host,
        port=args.port,
        log_level="info",
    )
    return 0


def _check_listen_args(args: argparse.Namespace) -> None:
    """StartupError for a port outside 1-65535 or fewer than one worker (argparse has checked they are ints)."""
    if not 1 <= args.port <= 65535:
        raise StartupError(f"--port {args.port}: a port is a whole number from 1 to 65535")
    if args.workers < 1:
        raise StartupError(f"--workers {args.workers}: at least 1 worker process")


def _check_can_listen(host: str, port: int) -> None:
    """StartupError (one line) unless ``host:port`` can be bound now: a port in use, a host this machine does
    not have or cannot resolve, a port below 1024 without the privilege.

    The probe binds every address ``host`` resolves to, with ``SO_REUSEADDR`` as uvicorn and asyncio
    do (a port whose last connections linger in TIME_WAIT is free), then lets go; uvicorn binds again
    right after, so only a process that takes the port in between can still make it fail (uvicorn
    then logs the error and exits with status 1).
    """
    where = f"{_url_host(host)}:{port}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise StartupError(f"cannot listen on {where}: host {host!r} not found ({_first_line(exc)})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reason = exc.strerror or _first_line(exc)
                raise StartupError(f"cannot listen on {where}: {reason}") from None


def _checked_settings(args: argparse.Namespace) -> Settings:
    """The effective settings (flags over ``QKWATCH_*`` over defaults), validated with the rules file.

    Raises:
        StartupError: a setting is invalid, authentication is off on a host that is not loopback
            (however it was switched off), or the rules file is unreadable or invalid.
    """
    from qkwatch.monitor.main import load_rules

    overrides: dict[str, Any] = {"open_access": True} if args.open else {}
    if args.rules:
        overrides["alert_rules_file"] = args.rules
    settings = _settings(args, **overrides)
    if settings.open_access and not is_loopback(args.host):
        raise StartupError(
            f"authentication is off (--open or QKWATCH_OPEN_ACCESS=true), which is only allowed on a "
            f"loopback host (127.0.0.1, ::1, localhost), not {args.host!r}"
        )
    try:
        load_rules(settings)
    except ValueError as exc:
        raise StartupError(f"rules file {settings.alert_rules_file}: {exc}") from None
    return settings


FLAGS = {"database_url": "--database-url", "alert_rules_file": "--rules", "open_access": "--open"}
"""The flag that sets a setting, for the messages about a value given by it."""


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    """The settings, flags over ``QKWATCH_*`` over defaults; StartupError naming the variable (or the flag)
    and the value of the first bad one."""
    from qkwatch.monitor.settings import SettingError, load_settings

    if getattr(args, "database_url", None) is not None:
        overrides["database_url"] = args.database_url
    try:
        return load_settings({k: FLAGS[k] for k in overrides if k in FLAGS}, **overrides)
    except SettingError as exc:
        raise StartupError(f"setting {exc}") from None


def _database_source(args: argparse.Namespace) -> str:
    """Where the database URL came from, for messages: the flag, the variable or the default."""
    if getattr(args, "database_url", None) is not None:
        return "--database-url"
    return "QKWATCH_DATABASE_URL" if os.environ.get("QKWATCH_DATABASE_URL") is not None else "the default"


def _prepare_database(settings: Settings, source: str) -> None:
    """Connect and migrate; StartupError (one line, no password) when the URL or the database is unusable."""
    _open_database(settings, source).dispose()


def _open_database(settings: Settings, source: str) -> Engine:
    """An engine on the migrated database; StartupError (one line naming the URL, never its password, and
    where it came from) when the URL or the database is unusable."""
    _quiet_alembic()
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from qkwatch.monitor.store.engine import make_engine
    from qkwatch.monitor.store.migrate import upgrade

    url = f"{_redact(settings.database_url)} ({source})"
    try:
        engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    except (ValueError, ImportError, SQLAlchemyError) as exc:
        raise StartupError(f"database URL {url}: {_first_line(exc)}") from None
    try:
        upgrade(engine)
    except (SQLAlchemyError, CommandError, OSError) as exc:
        engine.dispose()
        cause = getattr(exc, "orig", None) or exc
        raise StartupError(f"cannot use the database {url}: {_first_line(cause)}") from None
    return engine


def _quiet_alembic() -> None:
    """Alembic logs a line per plugin when it is first imported: keep a command's stderr to what matters."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL SQLAlchemy can parse; still never print what may be a password
        return re.sub(r"://([^:/@]*):[^@]*@", r"://\1:***@", url)


def _store(args: argparse.Namespace) -> Store:
    """The store on the migrated database of ``--database-url`` (else the settings); StartupError when the
    settings, the URL or the database are unusable."""
    engine = _open_database(_settings(args), _database_source(args))
    from qkwatch.monitor.store.store import Store  # after _open_database has quietened alembic's import

    return Store(engine)


def _token(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("token", help="mint, list or revoke API tokens")
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="mint a token (printed once; only its hash is stored)")
    c.add_argument("--project", required=True, help="project the token acts on ('*' for all projects)")
    c.add_argument(
        "--scope",
        action="append",
        choices=["ingest", "read", "control"],
        required=True,
        help="repeat for several scopes",
    )
    c.add_argument("--name", default=None, help="a name for the audit trail (default: the token id)")
    _database_arg(c)
    c.set_defaults(handler=cmd_token_create)
    ls = tsub.add_parser("list", help="list tokens (never their secrets)")
    _database_arg(ls)
    ls.set_defaults(handler=cmd_token_list)
    rv = tsub.add_parser("revoke", help="revoke a token by id")
    rv.add_argument("id", help="the token's id (first column of `qkwatch token list`)")
    _database_arg(rv)
    rv.set_defaults(handler=cmd_token_revoke)


@one_line_errors("token create")
def cmd_token_create(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        row, secret = store.create_token(args.project, sorted(set(args.scope)), args.name)
    finally:
        store.close()
    print(secret)
    print(
        f"token {row.id} ({row.name}) for project {row.project!r} with scopes {', '.join(sorted(row.scopes))}; "
        "it is shown only this once",
        file=sys.stderr,
    )
    return 0


@one_line_errors("token list")
def cmd_token_list(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        tokens = store.list_tokens()
    finally:
        store.close()
    rows = [
        [t.id, t.name, t.project, ",".join(sorted(t.scopes)), "revoked" if t.revoked_at else "active"] for t in tokens
    ]
    print(table(["id", "name", "project", "scopes", "state"], rows))
    return 0


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: a header row, then one line per row, columns aligned two spaces apart.

    Plain text so that it greps, pipes and pastes; ``--json`` is the form for programs. The last
    column is not padded (a long summary does not drag trailing blanks along).
    """
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=False)) + "  " + line[-1]
        if len(line) > 1
        else line[0]
        for line in [headers, *rows]
    )


@one_line_errors("token revoke")
def cmd_token_revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        ok = store.revoke_token(args.id)
    finally:
        store.close()
    if not ok:
        print(f"no token {args.id}", file=sys.stderr)
    return 0 if ok else 1


def _db(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("db", help="database maintenance")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = dsub.add_parser("upgrade", help="apply the migrations")
    _database_arg(up)
    up.set_defaults(handler=cmd_db_upgrade)


@one_line_errors("db upgrade")
def cmd_db_upgrade(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _prepare_database(settings, _database_source(args))
    print(f"database {_redact(settings.database_url)} is up to date")
    return 0


def _runs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _client_args(ls)
    ls.set_defaults(handler=cmd_runs_list)
    show = rsub.add_parser(
        "show",
        help="one run as JSON: the run, its lambdas and its open alerts (firing, or ended with the run while firing)",
    )
    show.add_argument("run", help="run id or project/name")
    _client_args(show)
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
        _client_args(t)
        t.set_defaults(handler=cmd_runs_tag)
    note = rsub.add_parser(
        "note",
        help="set a run's notes (an ingest or control token)",
        description="Set the run's notes, replacing what they held: free text up to 10 KiB. '-' reads them "
        "from standard input; '' clears them.",
    )
    note.add_argument("run", help="run id or project/name")
    note.add_argument("text", help="the notes; '-': read standard input; '': clear them")
    _client_args(note)
    note.set_defaults(handler=cmd_runs_note)
    rm = rsub.add_parser("delete", help="delete a run and all its points (control scope)")
    rm.add_argument("run", help="run id or project/name")
    rm.add_argument("--yes", action="store_true", help="do not ask")
    _client_args(rm)
    rm.set_defaults(handler=cmd_runs_delete)


def _client(args: argparse.Namespace) -> Client:
    """A client of ``--url`` (else ``QKWATCH_URL``); StartupError for a URL that is not http(s) with a host,
    or a token that cannot be sent in a header."""
    from qkwatch.monitor.client import Client

    _check_endpoint(args.url, args.token)
    return Client(args.url, token=args.token)


def _check_endpoint(url: str | None, token: str | None) -> None:
    """StartupError for a collector URL that is not http(s) with a host (and a port from 1 to 65535), or a
    token that cannot travel as ``Authorization: Bearer <token>`` (printable ASCII without a space)."""
    from qkwatch.monitor.settings import check_http_url

    if url:
        try:
            check_http_url(url)
        except ValueError as exc:
            raise StartupError(f"--url (or QKWATCH_URL): {exc}") from None
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise StartupError("--token (or QKWATCH_TOKEN) holds a space, a control character or non-ASCII text")


def _fail(exc: Exception) -> int:
    print(f"qkwatch: {exc}", file=sys.stderr)
    return 1


@one_line_errors("runs list")
def cmd_runs_list(args: argparse.Namespace) -> int:
    from qkwatch.monitor.client import CollectorError

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
        with _client(args) as c:
            runs = c.search_runs(
                args.project, status=args.status, name=args.name, tags=args.tag, max_results=args.limit, **filters
            )
    except CollectorError as exc:
        return _fail(exc)
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
    from qkwatch.monitor.client import CollectorError

    try:
        with _client(args) as c:
            run = c.tag(args.run, *args.tags) if args.runs_command == "tag" else c.untag(args.run, *args.tags)
    except CollectorError as exc:
        return _fail(exc)
    print(f"{run.ref}: tags {_tag_cell(run.tags)}")
    return 0


@one_line_errors("runs note")
def cmd_runs_note(args: argparse.Namespace) -> int:
    from qkwatch.monitor.client import CollectorError

    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        with _client(args) as c:
            run = c.update_run(args.run, notes=text)
    except CollectorError as exc:
        return _fail(exc)
    said = f"set ({len(run.notes)} characters)" if run.notes else "cleared"
    print(f"{run.ref}: notes {said}")
    return 0


@one_line_errors("runs show")
def cmd_runs_show(args: argparse.Namespace) -> int:
    from qkwatch.monitor.client import CollectorError

    try:
        with _client(args) as c:
            run = c.run(args.run)
            # Open: nothing resolved them. An alert still firing when the run ended is "ended", with its last values.
            alerts = [a for state in ("firing", "ended") for a in c.alerts(run=run.id, state=state).raw["data"]]
            print(json.dumps({"run": run.raw, "lambdas": c.lambdas(run.id).raw, "alerts": alerts}, indent=2))
    except CollectorError as exc:
        return _fail(exc)
    return 0


@one_line_errors("runs delete")
def cmd_runs_delete(args: argparse.Namespace) -> int:
    from qkwatch.monitor.client import CollectorError

    if not args.yes and (not sys.stdin.isatty() or input(f"delete run {args.run} and all its points? [y/N] ") != "y"):
        print("not deleted (pass --yes)", file=sys.stderr)
        return 1
    try:
        with _client(args) as c:
            c.delete_run(args.run)
    except CollectorError as exc:
        return _fail(exc)
    print(f"deleted run {args.run}")
    return 0


def _alerts(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _client_args(p)
    p.set_defaults(handler=cmd_alerts)
    asub = p.add_subparsers(dest="alerts_command", metavar="ACTION")  # optional: plain `alerts` lists them
    _backtest(asub)


def _backtest(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    _client_args(p)
    p.set_defaults(handler=cmd_alerts_backtest)


@one_line_errors("alerts")
def cmd_alerts(args: argparse.Namespace) -> int:
    from qkwatch.monitor.client import CollectorError

    try:
        with _client(args) as c:
            alerts = c.alerts(run=args.run, state=args.state)
    except CollectorError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(alerts.raw, indent=2))
        return 0
    headers = ["state", "severity", "run", "rule", "layers", "onset step", "end", "last values", "summary"]
    print(table(headers, [_alert_row(a) for a in alerts.raw["data"]]))
    return 0


STATE_TEXT = {"ended": "run ended while firing"}
"""How a table shows an alert's state; an ended alert is never shown as resolved."""


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
        STATE_TEXT.get(a["state"], a["state"]),
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


@one_line_errors("alerts backtest")
def cmd_alerts_backtest(args: argparse.Namespace) -> int:
    from qkwatch.monitor import backtest
    from qkwatch.monitor.client import CollectorError
    from qkwatch.monitor.outcomes import OutcomeRule

    try:
        outcome_rule = OutcomeRule.parse(args.outcome)
    except ValueError as exc:
        print(f"qkwatch alerts backtest: --outcome: {exc}", file=sys.stderr)
        return 2
    try:
        with _client(args) as c:
            collapse = c.collapse_threshold()
            try:
                rules = _backtest_rules(args.rules, collapse)
            except ValueError as exc:
                print(f"qkwatch alerts backtest: rules file {args.rules}: {exc}", file=sys.stderr)
                return 2
            histories = [backtest.read(c, run) for run in args.runs]
    except CollectorError as exc:
        return _fail(exc)
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

    from qkwatch.monitor.alerting.rules import RuleSet

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


def _report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML report of a run (opens with no network)")
    p.add_argument("run", help="run id or project/name")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument("--vs", default=None, metavar="RUN2", help="a second run to compare with, side by side")
    p.add_argument("--url", default=None, help="collector URL (default: $QKWATCH_URL)")
    p.add_argument("--token", default=None, help="read token (default: $QKWATCH_TOKEN)")
    p.set_defaults(handler=cmd_report)


@one_line_errors("report")
def cmd_report(args: argparse.Namespace) -> int:
    from qkwatch.monitor.report import ReportError, write_report

    _check_endpoint(args.url or os.environ.get("QKWATCH_URL"), args.token or os.environ.get("QKWATCH_TOKEN"))
    try:
        out = write_report(args.run, args.out, vs=args.vs, url=args.url, token=args.token)
    except (ReportError, OSError) as exc:
        print(f"qkwatch report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
