"""Every command the README shows refers to something that exists on a fresh clone.

The README promises that after ``make demo`` or ``make test`` its commands run as written from the
repository root, without activating ``.venv``. So each command line of its shell blocks (and each
inline ``.venv/bin/...`` command) must name: a Makefile target (``make X``); a tool that the set-up
installs into the virtualenv (``.venv/bin/X``, checked against the bin folder of the virtualenv
running these tests); for ``qkwatch``, a subcommand and options that its own parser accepts; for
``python -m`` and ``torchrun -m``, a module that can be imported; and files of the repository
(``examples/...``, ``dashboards/...``). A bare ``qkwatch``, ``python`` or ``torchrun`` counts only
after ``. .venv/bin/activate`` in the same block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qkwatch.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.prefix) / "bin"
"""The virtualenv running the tests: under ``make test``, the ``.venv`` that the README's commands use."""
FENCE = re.compile(r"^```\s*(\w*)")
SHELL = ("", "bash", "sh", "shell", "console")
"""Languages of a fenced block that holds commands (no language: a command block, as in the README)."""
INLINE_COMMAND = re.compile(r"`(\.venv/bin/\w[^`]*)`")
ACTIVATE = re.compile(r"^(\.|source)\s+\.venv/bin/activate\s*$")
REPO_DIRS = ("bench/", "docs/", "examples/", "experiments/", "qkwatch/", "tests/")
"""A word that starts with one of these names a file or folder of the clone, which must exist."""
ACTIVATED_TOOLS = ("qkwatch", "python", "python3", "pip", "torchrun", "pytest", "mkdocs")
SHELL_TOOLS = ("cd", "rm", "echo", "cat", "head", "export")
CONTROL = {"|", "||", "&", "&&", ";"}


def shell_blocks(text: str) -> list[str]:
    """The contents of the fenced blocks in a shell language, fences paired in order."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            if language in SHELL:
                blocks.append("\n".join(lines))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def commands(block: str) -> Iterator[tuple[str, list[str], bool]]:
    """(line, words, activated) of each simple command of a shell block; ``a | b`` and ``a && b`` are two."""
    activated = False
    for line in block.replace("\\\n", " ").splitlines():
        if ACTIVATE.match(line.strip()):
            activated = True
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in CONTROL:
                if words:
                    yield line, words, activated
                words = []
            else:
                words.append(token)


def problems(line: str, words: list[str], activated: bool = False) -> list[str]:
    """What is wrong with one command (empty when everything it names exists)."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return []
    head, args = words[0], words[1:]
    found = [f"{line!r}: {p}" for p in _paths(args)]
    for inner in (m for word in args for m in re.findall(r"\$\((.*)\)", word)):  # $(...) is a command too
        found += [p for sub in commands(inner) for p in problems(sub[0], sub[1], activated or sub[2])]
    if head == "make":
        targets = [a for a in args if "=" not in a and not a.startswith("-")]
        return found + [f"{line!r}: no Makefile target {t!r}" for t in targets if t not in makefile_targets()]
    if head.startswith(".venv/bin/"):
        tool = head.removeprefix(".venv/bin/")
        if not (VENV_BIN / tool).is_file():
            return [*found, f"{line!r}: the set-up installs no {head} (not in {VENV_BIN})"]
    elif head in ACTIVATED_TOOLS:
        if not activated:
            return [*found, f"{line!r}: bare {head}: write .venv/bin/{head}, or activate .venv first in the block"]
        tool = head
    elif head in SHELL_TOOLS:
        return found
    else:
        return [*found, f"{line!r}: {head} is neither a make target nor a tool of .venv"]
    return found + [f"{line!r}: {p}" for p in _tool_problems(tool, args)]


def _tool_problems(tool: str, args: list[str]) -> list[str]:
    if tool == "qkwatch":
        return _qkwatch_problems(args)
    if tool in ("python", "python3", "torchrun"):
        if "-m" in args:
            return _module_problems(args[args.index("-m") + 1])
        script = next((a for a in args if a.endswith(".py")), None)
        if tool == "torchrun" and script is None:
            return ["torchrun without -m MODULE or a script"]
        if script is not None and not (ROOT / script).is_file():
            return [f"{script} does not exist"]
    return []


def _qkwatch_problems(args: list[str]) -> list[str]:
    """What ``qkwatch``'s parser refuses: an unknown subcommand, option or missing argument."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            if exc.code:
                return [f"qkwatch refuses it: {err.getvalue().strip().splitlines()[-1]}"]
    return []


def _module_problems(module: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{module}.__main__")
    except ModuleNotFoundError:
        spec = None
    return [] if spec is not None else [f"no module {module} to run with -m"]


def _paths(args: list[str]) -> list[str]:
    return [
        f"{a} does not exist"
        for a in args
        if a.startswith(REPO_DIRS) and not ("*" in a and any(ROOT.glob(a))) and not (ROOT / a).exists()
    ]


def readme_commands() -> list[tuple[str, list[str], bool]]:
    text = README.read_text()
    found = [c for block in shell_blocks(text) for c in commands(block)]
    return found + [c for inline in INLINE_COMMAND.findall(text) for c in commands(inline.replace("\n", " "))]


def test_every_readme_command_refers_to_what_exists() -> None:
    found = readme_commands()
    assert len(found) >= 15, f"only {len(found)} commands found: is the README's code fence format the parser's?"
    assert {words[0] for _, words, _ in found} >= {"make", ".venv/bin/qkwatch", ".venv/bin/python"}
    wrong = [p for line, words, activated in found for p in problems(line, words, activated)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "block",
    [
        ".venv/bin/qkwatch nosuchcommand",
        ".venv/bin/qkwatch runs list --no-such-flag",
        ".venv/bin/qkwatch runs show",  # its RUN is missing
        ".venv/bin/nosuchtool --help",
        ".venv/bin/python -m experiments.nothere",
        ".venv/bin/python examples/gone.py",
        "QKWATCH_URL=http://127.0.0.1:8000 .venv/bin/python examples/gone.py",
        ".venv/bin/torchrun --nproc_per_node 2 examples/gone.py",
        ".venv/bin/torchrun --nproc_per_node 2 -m qkwatch.nothere --recipe debug_cpu",
        ".venv/bin/qkwatch serve --open --rules qkwatch/dashboards/rules/gone.yml",
        ".venv/bin/qkwatch runs list | .venv/bin/nosuchtool",
        'echo "$(.venv/bin/python -m nothere)"',
        "qkwatch serve --open",  # bare, never activated
        "python examples/hf_trainer.py",
        "make nosuchtarget",
        "docker compose up -d",
    ],
)
def test_the_checker_finds_a_broken_line(block: str) -> None:
    found = list(commands(block))
    assert found and [p for line, words, activated in found for p in problems(line, words, activated)]


@pytest.mark.parametrize(
    "block",
    [
        "make test TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'   # CPU only",
        ".venv/bin/qkwatch runs list --qkai-above 0.7 --collapse-band   # a comment",
        "QKWATCH_URL=http://127.0.0.1:8000 .venv/bin/python examples/hf_trainer.py",
        ".venv/bin/torchrun --nproc_per_node 2 -m qkwatch.trainer --recipe debug_cpu",
        ".venv/bin/python -m experiments.report",
        ". .venv/bin/activate\nqkwatch serve --open --rules qkwatch/dashboards/rules/detectors.yml",
        ".venv/bin/qkwatch runs list | head -1",
    ],
)
def test_the_checker_passes_a_good_line(block: str) -> None:
    found = list(commands(block))
    assert found and [p for line, words, activated in found for p in problems(line, words, activated)] == []
