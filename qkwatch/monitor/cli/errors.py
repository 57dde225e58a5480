"""How a collector command stops before its work: a :class:`StartupError` printed as one line, status 2."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable


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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
