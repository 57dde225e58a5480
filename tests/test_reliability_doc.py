"""docs/reliability.md maps each promise to the tests that hold it: every promise row cites at
least one test, and every cited ``tests/....py::name`` is a test function defined in that file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reliability.md"
CITE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _rows(text: str) -> list[str]:
    """The promise tables' body rows (a table whose header names a test column)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("|") and "held by" in line.lower():
            in_table = True
            continue
        if in_table and line.startswith("|"):
            if not set(line) <= set("|-: "):
                rows.append(line)
        else:
            in_table = False
    return rows


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_citations(text: str) -> list[str]:
    """Citations of the page that name no test, and promise rows that cite none."""
    out = [f"a promise without a test: {row}" for row in _rows(text) if not CITE.search(row)]
    for path, name in CITE.findall(text):
        file = ROOT / path
        if not file.is_file():
            out.append(f"{path} does not exist")
        elif not name.startswith("test_") or name not in _functions(file):
            out.append(f"{path}::{name} is not a test defined there")
    return out


def test_every_promise_cites_a_test_that_exists() -> None:
    text = PAGE.read_text()
    assert len(_rows(text)) >= 10, "the page lists the collector's promises in tables with a 'held by' column"
    assert missing_citations(text) == []


def test_the_checker_finds_what_is_missing() -> None:
    page = (
        "| promise | held by |\n|---|---|\n"
        "| a | `tests/test_reliability_doc.py::test_every_promise_cites_a_test_that_exists` |\n"
        "| b | nothing |\n"
        "| c | `tests/test_reliability_doc.py::test_no_such_thing` |\n"
        "| d | `tests/no_such_file.py::test_x` |\n"
    )
    assert missing_citations(page) == [
        "a promise without a test: | b | nothing |",
        "tests/test_reliability_doc.py::test_no_such_thing is not a test defined there",
        "tests/no_such_file.py does not exist",
    ]
