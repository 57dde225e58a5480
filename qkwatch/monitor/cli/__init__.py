"""The collector's subcommands: ``serve``, ``token``, ``db``, ``runs``, ``alerts`` (and ``alerts backtest``),
``report`` and ``dashboards``, one module per command group.

Only argparse at import time (``qkwatch --help`` stays fast); everything else is imported inside
the handlers.
"""

from __future__ import annotations

import argparse

from qkwatch.monitor import dashboards
from qkwatch.monitor.cli import alerts, db, report, runs, serve, tokens


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve.register(subparsers)
    tokens.register(subparsers)
    db.register(subparsers)
    runs.register(subparsers)
    alerts.register(subparsers)
    report.register(subparsers)
    dashboards.register(subparsers)
