"""The collector's subcommands: ``serve``, ``token``, ``db``, ``runs``, ``alerts``.

Only argparse at import time (``qkwatch --help`` stays fast); everything else is imported inside
the handlers.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys

from monitor import dashboards

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers: argparse._SubParsersAction) -> None:
    _serve(subparsers)
    _token(subparsers)
    _db(subparsers)
    _runs(subparsers)
    _alerts(subparsers)
    _report(subparsers)
    dashboards.register(subparsers)


def _database_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL (default: $QKWATCH_DATABASE_URL or sqlite:///qkwatch.db)")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("QKWATCH_URL", DEFAULT_URL),
                   help="collector URL (default: $QKWATCH_URL or %(default)s)")
    p.add_argument("--token", default=os.environ.get("QKWATCH_TOKEN"), help="bearer token (default: $QKWATCH_TOKEN)")


def _serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the collector (migrates the database first)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from monitor.settings import Settings
    from monitor.store.engine import make_engine
    from monitor.store.migrate import upgrade

    if args.open and not is_loopback(args.host):
        print(f"qkwatch serve: --open skips authentication and is only allowed on a loopback host "
              f"(127.0.0.1, ::1, localhost), not {args.host!r}", file=sys.stderr)
        return 2
    overrides: dict = {"open_access": args.open} if args.open else {}
    if args.database_url:
        overrides["database_url"] = args.database_url
    if args.rules:
        overrides["alert_rules_file"] = args.rules
    settings = Settings(**overrides)
    if settings.open_access:
        logger.warning("!!! AUTHENTICATION IS OFF (--open): anyone who can reach %s:%d can read, write and "
                       "steer runs. For a local demo only. !!!", args.host, args.port)
    engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    upgrade(engine)
    engine.dispose()
    print(f"qkwatch collector listening on http://{_url_host(args.host)}:{args.port} "
          f"(database {_redact(settings.database_url)})", flush=True)
    if args.workers > 1:
        # Workers import the app themselves and read their settings from the environment.
        os.environ.update({"QKWATCH_DATABASE_URL": settings.database_url,
                           "QKWATCH_OPEN_ACCESS": str(settings.open_access).lower()})
        if settings.alert_rules_file:
            os.environ["QKWATCH_ALERT_RULES_FILE"] = str(settings.alert_rules_file)
        uvicorn.run("monitor.main:app_from_env", factory=True, host=args.host, port=args.port,
                    workers=args.workers, log_level="info")
        return 0
    from monitor.main import create_app

    uvicorn.run(create_app(settings.model_copy(update={"auto_migrate": False})), host=args.host, port=args.port,
                log_level="info")
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _settings(args: argparse.Namespace):
    from monitor.settings import Settings

    return Settings(database_url=args.database_url) if args.database_url else Settings()


def _store(args: argparse.Namespace):
    from monitor.store.engine import make_engine
    from monitor.store.migrate import upgrade
    from monitor.store.store import Store

    settings = _settings(args)
    engine = make_engine(settings.database_url)
    upgrade(engine)
    return Store(engine)


def _token(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="mint, list or revoke API tokens")
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="mint a token (printed once; only its hash is stored)")
    c.add_argument("--project", required=True, help="project the token acts on ('*' for all projects)")
    c.add_argument("--scope", action="append", choices=["ingest", "read", "control"], required=True,
                   help="repeat for several scopes")
    c.add_argument("--name", default=None, help="a name for the audit trail (default: the token id)")
    _database_arg(c)
    c.set_defaults(handler=cmd_token_create)
    ls = tsub.add_parser("list", help="list tokens (never their secrets)")
    _database_arg(ls)
    ls.set_defaults(handler=cmd_token_list)
    rv = tsub.add_parser("revoke", help="revoke a token by id")
    rv.add_argument("id")
    _database_arg(rv)
    rv.set_defaults(handler=cmd_token_revoke)


def cmd_token_create(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        row, secret = store.create_token(args.project, sorted(set(args.scope)), args.name)
    finally:
        store.close()
    print(secret)
    print(f"token {row.id} ({row.name}) for project {row.project!r} with scopes {', '.join(sorted(row.scopes))}; "
          "it is shown only this once", file=sys.stderr)
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        for t in store.list_tokens():
            state = "revoked" if t.revoked_at else "active"
            print(f"{t.id}\t{t.name}\t{t.project}\t{','.join(sorted(t.scopes))}\t{state}")
    finally:
        store.close()
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        ok = store.revoke_token(args.id)
    finally:
        store.close()
    if not ok:
        print(f"no token {args.id}", file=sys.stderr)
    return 0 if ok else 1


def _db(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="database maintenance")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = dsub.add_parser("upgrade", help="apply the migrations")
    _database_arg(up)
    up.set_defaults(handler=cmd_db_upgrade)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    _store(args).close()
    print(f"database {_redact(_settings(args).database_url)} is up to date")
    return 0


def _runs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="list, show or delete runs (through the collector's API)")
    rsub = p.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    ls = rsub.add_parser("list")
    ls.add_argument("--project")
    ls.add_argument("--status", choices=["running", "finished", "crashed"])
    ls.add_argument("--json", action="store_true")
    _client_args(ls)
    ls.set_defaults(handler=cmd_runs_list)
    show = rsub.add_parser("show")
    show.add_argument("run")
    _client_args(show)
    show.set_defaults(handler=cmd_runs_show)
    rm = rsub.add_parser("delete", help="delete a run and all its points (control scope)")
    rm.add_argument("run")
    rm.add_argument("--yes", action="store_true", help="do not ask")
    _client_args(rm)
    rm.set_defaults(handler=cmd_runs_delete)


def _client(args: argparse.Namespace):
    from monitor.client import Client

    return Client(args.url, token=args.token)


def _fail(exc: Exception) -> int:
    print(f"qkwatch: {exc}", file=sys.stderr)
    return 1


def cmd_runs_list(args: argparse.Namespace) -> int:
    from monitor.client import CollectorError

    try:
        with _client(args) as c:
            runs = c.runs(project=args.project, status=args.status, limit=1000)
    except CollectorError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    for r in runs["data"]:
        print(f"{r['id']}\t{r['project']}/{r['name']}\t{r['status']}\tattempt {r['latest_attempt']}\t"
              f"step {r['last_step']}")
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    from monitor.client import CollectorError

    try:
        with _client(args) as c:
            print(json.dumps({"run": c.run(args.run), "lambdas": c.lambdas(args.run),
                              "alerts": c.alerts(run=args.run, state="firing")["data"]}, indent=2))
    except CollectorError as exc:
        return _fail(exc)
    return 0


def cmd_runs_delete(args: argparse.Namespace) -> int:
    from monitor.client import CollectorError

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


def _alerts(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("alerts", help="list alerts (through the collector's API)")
    p.add_argument("--run")
    p.add_argument("--state", choices=["firing", "resolved"])
    p.add_argument("--json", action="store_true")
    _client_args(p)
    p.set_defaults(handler=cmd_alerts)


def cmd_alerts(args: argparse.Namespace) -> int:
    from monitor.client import CollectorError

    try:
        with _client(args) as c:
            alerts = c.alerts(run=args.run, state=args.state)
    except CollectorError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(alerts, indent=2))
        return 0
    for a in alerts["data"]:
        print(f"{a['state']:8}\t{a['severity']}\t{a['project']}/{a['run_name']}\t{a['rule']}\tlayers "
              f"{','.join(map(str, a['layers']))}\tonset step {a['onset_step']}\t{a['summary']}")
    return 0


def _report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML report of a run (opens with no network)")
    p.add_argument("run", help="run id or project/name")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument("--vs", default=None, metavar="RUN2", help="a second run to compare with, side by side")
    p.add_argument("--url", default=None, help="collector URL (default: $QKWATCH_URL)")
    p.add_argument("--token", default=None, help="read token (default: $QKWATCH_TOKEN)")
    p.set_defaults(handler=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from monitor.report import ReportError, write_report

    try:
        out = write_report(args.run, args.out, vs=args.vs, url=args.url, token=args.token)
    except (ReportError, OSError) as exc:
        print(f"qkwatch report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
