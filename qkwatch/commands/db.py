"""``qkwatch db upgrade``: migrate the collector's database without serving it (``serve`` migrates too)."""

from __future__ import annotations

import argparse

from qkwatch.commands.database import database_arg, database_source, effective_settings, prepare_database, redact
from qkwatch.commands.errors import one_line_errors


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("db", help="database maintenance")
    dsub = p.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = dsub.add_parser("upgrade", help="apply the migrations")
    database_arg(up)
    up.set_defaults(handler=cmd_db_upgrade)


@one_line_errors("db upgrade")
def cmd_db_upgrade(args: argparse.Namespace) -> int:
    settings = effective_settings(args)
    prepare_database(settings, database_source(args))
    print(f"database {redact(settings.database_url)} is up to date")
    return 0
