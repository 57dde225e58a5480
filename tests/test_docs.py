"""docs/architecture.md and docs/metrics.md name only what exists: every file, module and ``file.py: name`` they cite.

The check reads the page the way a newcomer does. In a section headed by a folder (``### qkwatch/agent/``,
``### tests/``) a table's file column is relative to that folder; everywhere else a path is
relative to the repository root, and only text with a ``/`` is taken for a path (``cursor.json``
in prose is a file at run time, not in the tree). A citation ``path.py: name`` (or
``path.py: Class.method``) must name a function, class, assignment or method defined in that
file; a dotted ``qkwatch.x.y`` must be a module, or a name defined in one. Brace lists expand (``test_{a,b}.py``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "metrics.md"]
PATH_LIKE = re.compile(r"^[\w.{},*-]+(/[\w.{},*-]*)+$|^[\w{},-]+\.(py|md|yml|yaml|json|html|sh|toml|ini|mako)$")
CITATION = re.compile(r"^(?P<path>[\w/{},.-]+\.py): (?P<names>[\w., ]+)$")
DOTTED = re.compile(r"^qkwatch(\.\w+)+$")
FILE_SUFFIX = re.compile(r"\.(py|md|yml|yaml|json|html|sh|toml|ini|mako|template|txt)$")


@dataclass(frozen=True)
class Reference:
    line: int
    text: str
    base: str
    """The folder a table's file column is relative to (the section's heading), else ""."""
    file_column: bool = False
    """In a table's first column, where a bare file name (no folder) names a file too."""
    sibling: str = ""
    """The folder of the cell's first path: ``a/b.py``, ``c.py`` names ``a/c.py``."""

    def candidates(self, text: str) -> list[str]:
        """Where a relative path may point: the section's folder, the cell's first folder, the root."""
        return [prefix + text for prefix in dict.fromkeys((self.base, self.base + self.sibling, ""))]


def references(page: Path) -> Iterator[Reference]:
    base = ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("#"):
            heading = line.lstrip("#").strip().strip("`")
            base = heading if heading.endswith("/") and (ROOT / heading).is_dir() else ""
        table = line.startswith("|") and not set(line) <= set("|- ")
        for column, cell in enumerate(line.split("|")):
            file_column = table and column == 1
            sibling = ""
            for text in re.findall(r"`([^`]+)`", cell):
                yield Reference(number, text.strip(), base if file_column else "", file_column, sibling)
                if file_column and not sibling and "/" in text.rstrip("/"):
                    sibling = text.rstrip("/").rsplit("/", 1)[0] + "/"


def expand(text: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one brace group at a time)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    head, tail = text[: match.start()], text[match.end() :]
    return [x for option in match.group(1).split(",") for x in expand(head + option + tail)]


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and ``Class.member`` for their members."""
    tree = ast.parse(path.read_text())
    names: set[str] = set(_all_of(tree))  # a lazy public name (module __getattr__) is in __all__
    for node in tree.body:
        for name in _names_of(node):
            names.add(name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{name}.{member}" for child in node.body for member in _names_of(child))
    return names


def _all_of(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
    return []


def _names_of(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):  # re-exports count as names of the module
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def module_file(dotted: str) -> tuple[Path, list[str]] | None:
    """The longest module prefix of ``qkwatch.a.b.c`` as a file, and the attribute path after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        folder = ROOT.joinpath(*parts[:cut])
        for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
            if candidate.is_file():
                return candidate, parts[cut:]
    return None


def problems(ref: Reference) -> list[str]:
    """What is wrong with one cited name (empty when it exists); names that are not citations pass."""
    if DOTTED.match(ref.text) and not FILE_SUFFIX.search(ref.text):
        found = module_file(ref.text)
        if found is None:
            return [f"module {ref.text} does not exist"]
        path, attrs = found
        if attrs and ".".join(attrs[:2]) not in defined_names(path) and attrs[0] not in defined_names(path):
            return [f"{ref.text}: {path.relative_to(ROOT)} defines no {'.'.join(attrs)}"]
        return []
    citation = CITATION.match(ref.text)
    if citation:
        out = []
        for path_text in expand(citation["path"]):
            path = next((ROOT / c for c in ref.candidates(path_text) if (ROOT / c).is_file()), None)
            if path is None:
                out.append(f"{ref.base + path_text} does not exist")
                continue
            names = defined_names(path)
            out += [
                f"{path.relative_to(ROOT)} defines no {n}"
                for n in re.split(r",\s*", citation["names"])
                if n and n not in names
            ]
        return out
    if (
        PATH_LIKE.match(ref.text)
        and ("/" in ref.text or ref.file_column)
        and not ref.text.startswith(("http", "/", ".."))
    ):
        return [f"{ref.base + p} does not exist" for p in expand(ref.text) if not any(map(_exists, ref.candidates(p)))]
    return []


def _exists(path_text: str) -> bool:
    """A file or folder; a glob matches something; ``versions/0001`` is a numbered file's prefix."""
    if "*" in path_text:
        return any(ROOT.glob(path_text))
    if re.search(r"/\d+$", path_text):
        return any(ROOT.glob(path_text + "_*"))
    return (ROOT / path_text.rstrip("/")).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_module_and_name_the_architecture_page_cites_exists(page: Path) -> None:
    found = [f"{page.name}:{r.line}: {p}" for r in references(page) for p in problems(r)]
    assert not found, "\n".join(found)


def test_the_checker_finds_what_is_missing() -> None:
    assert problems(Reference(1, "qkwatch/agent/probe/probe.py", "")) == []
    assert problems(Reference(1, "probe/probe.py", "qkwatch/agent/", file_column=True)) == []
    assert problems(Reference(1, "cursor.json", "")) == []  # prose, no folder: not a path
    assert problems(Reference(1, "qkwatch/agent/nothere.py", "")) == ["qkwatch/agent/nothere.py does not exist"]
    assert problems(Reference(1, "qkwatch/agent/probe/plan.py: Plan, Plan.at", "")) == []
    assert problems(Reference(1, "qkwatch/agent/probe/probe.py: Ghost", "")) == [
        "qkwatch/agent/probe/probe.py defines no Ghost"
    ]
    assert problems(Reference(1, "metrics/{heads,spectra}.py", "qkwatch/agent/", file_column=True)) == []
    assert problems(Reference(1, "metrics/{heads,gone}.py", "qkwatch/agent/", True)) == [
        "qkwatch/agent/metrics/gone.py does not exist"
    ]
    assert problems(Reference(1, "qkwatch.agent.metrics", "")) == []
    assert problems(Reference(1, "qkwatch.agent.nothing", "")) == [
        "qkwatch.agent.nothing: qkwatch/agent/__init__.py defines no nothing"
    ]
    assert problems(Reference(1, "qkwatch.nowhere.x", "")) == [
        "qkwatch.nowhere.x: qkwatch/__init__.py defines no nowhere.x"
    ]
    assert problems(Reference(1, "qkwatch.contract.scheduling.ScheduleConfig", "")) == []
    assert problems(Reference(1, "--heads", "")) == []  # not a citation
    assert problems(Reference(1, "qkwatch.attach", "")) == []  # lazy, in __all__
    assert problems(Reference(1, "engine.py", "qkwatch/monitor/", True, sibling="store/")) == []
    assert problems(Reference(1, "gone.py", "qkwatch/monitor/", True, sibling="store/")) == [
        "qkwatch/monitor/gone.py does not exist"
    ]
    assert problems(Reference(1, "qkwatch/monitor/store/migrations/versions/0001", "")) == []
    assert problems(Reference(1, "qkwatch/monitor/store/migrations/versions/0099", "")) == [
        "qkwatch/monitor/store/migrations/versions/0099 does not exist"
    ]


def cited_files(page: Path) -> set[Path]:
    """The files of the tree a page cites, resolved the way :func:`problems` resolves them."""
    found: set[Path] = set()
    for ref in references(page):
        citation = CITATION.match(ref.text)
        text = citation["path"] if citation else ref.text
        if not (citation or (PATH_LIKE.match(text) and ("/" in text or ref.file_column))):
            continue
        for option in expand(text):
            for candidate in ref.candidates(option):
                found.update(
                    p.resolve() for p in ROOT.glob(candidate + ("_*" if re.search(r"/\d+$", candidate) else ""))
                )
    return found


def test_every_module_of_the_packages_has_a_row() -> None:
    """The other direction: a module added to a package without a line on the page fails here."""
    page = ROOT / "docs" / "architecture.md"
    modules = [p for p in (ROOT / "qkwatch").rglob("*.py") if p.name != "__init__.py" or p.parent == ROOT / "qkwatch"]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if p.resolve() not in cited_files(page))
    assert not missing, f"docs/architecture.md says nothing of {missing}"


def tree_block(page: Path) -> list[str]:
    """The lines of the page's drawing of the package (the fenced block that starts ``qkwatch/``)."""
    lines, inside, found = page.read_text().splitlines(), False, []
    for line in lines:
        if line.startswith("```"):
            if inside:
                break
            inside = False
            continue
        if line.strip() == "qkwatch/" and not found:
            inside = True
        if inside:
            found.append(line)
    return found


def test_the_package_tree_names_every_package_and_only_real_ones() -> None:
    """docs/architecture.md draws ``qkwatch/``: every folder it names there exists, and every package
    under ``qkwatch/`` (a folder with an ``__init__.py``) is named on the page: in the drawing (by
    its path below ``qkwatch/``, ``agent/metrics/``) or by its whole path (``qkwatch/agent/metrics/``)."""
    page = ROOT / "docs" / "architecture.md"
    drawn = tree_block(page)
    assert drawn, "docs/architecture.md has no drawing of qkwatch/"
    folders = [m.group(1) for line in drawn[1:] if (m := re.match(r"^\s+([\w/]+)/", line))]
    assert folders, drawn
    assert [f for f in folders if not (ROOT / "qkwatch" / f).is_dir()] == []
    text = page.read_text()
    packages = sorted(p.parent.relative_to(ROOT) for p in (ROOT / "qkwatch").rglob("__init__.py"))
    unnamed = [
        str(p)
        for p in packages
        if p != Path("qkwatch") and "/".join(p.parts[1:]) not in folders and f"{p}/" not in text
    ]
    assert not unnamed, f"docs/architecture.md names no package {unnamed}"
