"""How a collector command stops before its work: a :class:`StartupError` printed as one line, status 2."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

COLLECTOR_LIBRARIES = frozenset(
    {"fastapi", "fastapi_offline", "starlette", "uvicorn", "sqlalchemy", "alembic", "prometheus_client", "orjson"}
)
"""What ``qkwatch[collector]`` adds to ``pip install qkwatch``."""


class StartupError(Exception):
    """What stops a command before it does its work (a bad flag, setting, port or database), as one line
    for the operator; the command prints it after its name and exits with status 2."""


Handler = Callable[[argparse.Namespace], int]


def one_line_errors(command: str) -> Callable[[Handler], Handler]:
    """A handler that prints a :class:`StartupError` as ``qkwatch COMMAND: message`` and returns 2;
    the same for a collector library missing from an install without ``qkwatch[collector]``."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except StartupError as exc:
                print(f"qkwatch {command}: {exc}", file=sys.stderr)
                return 2
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] not in COLLECTOR_LIBRARIES:
                    raise
                print(
                    f"qkwatch {command}: needs the collector, which this install leaves out "
                    f"(no module {exc.name!r}): pip install 'qkwatch[collector]'",
                    file=sys.stderr,
                )
                return 2

        return run

    return decorate


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
