"""How the commands that go through a collector's REST API (``runs``, ``alerts``, ``report``) reach it:
the ``--url`` and ``--token`` flags, a checked :class:`~qkwatch.client.rest.Client`, and a refusal
of the collector as one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from qkwatch.commands.errors import StartupError

if TYPE_CHECKING:  # for annotations only: open_client imports the client when it runs
    from qkwatch.client.rest import Client

DEFAULT_URL = "http://127.0.0.1:8000"


def client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("QKWATCH_URL", DEFAULT_URL),
        help="collector URL (default: $QKWATCH_URL or %(default)s)",
    )
    p.add_argument("--token", default=os.environ.get("QKWATCH_TOKEN"), help="bearer token (default: $QKWATCH_TOKEN)")


def open_client(args: argparse.Namespace) -> Client:
    """A client of ``--url`` (else ``QKWATCH_URL``); StartupError for a URL that is not http(s) with a host,
    or a token that cannot be sent in a header."""
    from qkwatch.client.rest import Client

    check_endpoint(args.url, args.token)
    return Client(args.url, token=args.token)


def check_endpoint(url: str | None, token: str | None) -> None:
    """StartupError for a collector URL that is not http(s) with a host (and a port from 1 to 65535), or a
    token that cannot travel as ``Authorization: Bearer <token>`` (printable ASCII without a space)."""
    from qkwatch.contract.urls import check_http_url

    if url:
        try:
            check_http_url(url)
        except ValueError as exc:
            raise StartupError(f"--url (or QKWATCH_URL): {exc}") from None
    if token and not (token.isascii() and token.isprintable() and " " not in token):
        raise StartupError("--token (or QKWATCH_TOKEN) holds a space, a control character or non-ASCII text")


def fail(exc: Exception) -> int:
    """A refusal of the collector (or no answer) as ``qkwatch: message``; exit status 1."""
    print(f"qkwatch: {exc}", file=sys.stderr)
    return 1
