"""The collector's and its clients' subcommands: ``serve``, ``token``, ``db`` (the service, from
``qkwatch.monitor``), ``runs``, ``alerts`` (and ``alerts backtest``), ``report`` (through
``qkwatch.client``) and ``dashboards`` (``qkwatch.dashboards.push``), one module per command group.

Only argparse at import time (``qkwatch --help`` stays fast); everything else is imported inside
the handlers.
"""

from __future__ import annotations

import argparse

from qkwatch.commands import alerts, db, report, runs, serve, tokens
from qkwatch.dashboards import push as dashboards


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve.register(subparsers)
    tokens.register(subparsers)
    db.register(subparsers)
    runs.register(subparsers)
    alerts.register(subparsers)
    report.register(subparsers)
    dashboards.register(subparsers)
