"""The ``qkwatch`` command: one entry point, subcommands contributed by the components.

Each component owns its subcommands in its own ``cli`` module with a ``register(subparsers)``
function; those modules import only argparse at the top, so ``qkwatch --help`` stays fast and
the collector's host needs no torch. Unknown subcommands print the help.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable

from qkwatch import __version__

# (module, what it adds); a module that is missing or fails to import is skipped with a note.
COMPONENTS = ("qkwatch.agent.cli", "qkwatch.commands", "qkwatch.trainer.cli", "qkwatch.demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkwatch",
        description="Watch query-key subspace collapse while a transformer trains, and act on it.",
    )
    parser.add_argument("--version", action="version", version=f"qkwatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMPONENTS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but needs something not installed
                logging.getLogger(__name__).debug("%s unavailable: %s", name, exc)
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``qkwatch``: the command's exit status. A reader that closes the pipe early (``qkwatch runs list |
    head -1``) ends the command quietly, with status 1 (see :func:`closed_pipe_safe`)."""
    return closed_pipe_safe(_main, argv)


def closed_pipe_safe(command: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``command(argv)``; when its reader closed stdout, exit quietly instead of with a traceback.

    The recipe of the Python docs (library/signal, "Note on SIGPIPE"): catch ``BrokenPipeError`` at
    the top, flush inside the ``try`` (a buffered write fails only there), and point stdout at
    devnull so that the interpreter's own flush at exit does not fail again. Status 1, as Python
    gives on EPIPE; ``python -m qkwatch.trainer`` does the same.
    """
    try:
        code = command(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    commands = _commands(parser)
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is not None and first not in commands:
        parser.print_help()
        print(f"\nqkwatch: unknown command {first!r}; choose from {', '.join(sorted(commands))}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        quiet_http_logs()
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2 if args.command else 0
    return int(handler(args) or 0)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: a line per report and per poll would bury what matters."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


if __name__ == "__main__":
    sys.exit(main())
