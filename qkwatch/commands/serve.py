"""``qkwatch serve``: check the flags, the settings, the port and the database, then run the collector
under uvicorn. Everything that can be checked before uvicorn starts is, so that a bad value is one
:class:`StartupError` line, not a traceback from inside the server.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from qkwatch.commands.database import (
    database_arg,
    database_source,
    effective_settings,
    prepare_database,
    quiet_alembic,
    redact,
)
from qkwatch.commands.errors import StartupError, first_line, one_line_errors

if TYPE_CHECKING:  # for annotations only: the handler imports the settings when it runs
    from qkwatch.monitor.settings import Settings

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the collector (migrates the database first)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default %(default)s; 0.0.0.0 for all, which needs tokens)",
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    database_arg(p)
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


@one_line_errors("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    _check_listen_args(args)
    quiet_alembic()
    settings = _checked_settings(args)
    _check_can_listen(args.host, args.port)
    prepare_database(settings, database_source(args))
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
        f"(database {redact(settings.database_url)})",
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
        raise StartupError(f"cannot listen on {where}: host {host!r} not found ({first_line(exc)})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reason = exc.strerror or first_line(exc)
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
    settings = effective_settings(args, **overrides)
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


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
