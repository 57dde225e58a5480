"""The import directions of docs/architecture.md, held by a test.

* ``monitor`` never imports torch, ``agent``, ``trainer`` or ``qkwatch`` (a collector host needs no
  torch; the version comes from the installed distribution's metadata).
* ``agent`` imports from ``monitor`` only its pure modules, the wire schema and the schedule
  formula, and never ``trainer`` or ``qkwatch``.
* ``agent.metrics`` is pure math: tensors in, tensors out; no threads, sockets, files or hooks.
* nothing imports ``trainer`` but ``trainer`` itself and the top-level ``qkwatch`` glue, and
  ``trainer`` does not import ``qkwatch``.
* no two modules of ours import each other, directly or around a circle (imports inside functions
  count; a script's ``if __name__ == "__main__":`` block does not).
* ``bench/`` imports nothing from ``tests/`` (what both need lives in a package, e.g. ``qkwatch.launch``).
* ``experiments/`` sits on top of everything (it drives the trainer through subprocesses and reads
  the collector through the client); no package imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "monitor", "trainer", "qkwatch")
MONITOR_PURE = {"monitor.wire", "monitor.scheduling"}
IMPURE_FOR_METRICS = {
    "threading",
    "socket",
    "httpx",
    "requests",
    "urllib",
    "os",
    "io",
    "pathlib",
    "logging",
    "queue",
    "subprocess",
    "multiprocessing",
    "time",
}


def imports_of(path: Path, *, main_block: bool = True) -> list[str]:
    """Every absolute import of ``path``, ``module`` and ``module.name`` for ``from module import name``;
    ``main_block=False`` leaves out the top-level ``if __name__ == "__main__":`` block."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not main_block:
        tree.body = [node for node in tree.body if not is_main_block(node)]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def is_main_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", modules("monitor"), ids=lambda p: str(p.relative_to(ROOT)))
def test_monitor_imports_no_torch_agent_trainer_or_qkwatch(path: Path) -> None:
    bad = [n for n in imports_of(path) if top(n) in {"torch", "agent", "trainer", "qkwatch", "numpy", "safetensors"}]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", modules("agent"), ids=lambda p: str(p.relative_to(ROOT)))
def test_agent_imports_only_pure_monitor_modules(path: Path) -> None:
    names = imports_of(path)
    upward = [n for n in names if top(n) in {"trainer", "qkwatch"}]
    assert not upward, f"{path.relative_to(ROOT)} imports {upward}"
    bad = [
        n
        for n in names
        if top(n) == "monitor"
        and n not in MONITOR_PURE
        and not any(n.startswith(m + ".") for m in MONITOR_PURE)
        and n != "monitor"
    ]
    assert not bad, f"{path.relative_to(ROOT)} imports impure monitor modules {bad}"


@pytest.mark.parametrize("path", modules("agent/metrics"), ids=lambda p: str(p.relative_to(ROOT)))
def test_metrics_are_pure(path: Path) -> None:
    names = imports_of(path)
    ours = [n for n in names if top(n) in {"agent", "monitor", "trainer"} and not n.startswith("agent.metrics")]
    impure = [n for n in names if top(n) in IMPURE_FOR_METRICS]
    assert not ours and not impure, f"{path.relative_to(ROOT)} imports {ours + impure}"


@pytest.mark.parametrize("package", ["agent", "monitor"])
def test_nothing_imports_trainer(package: str) -> None:
    for path in modules(package):
        assert not [n for n in imports_of(path) if top(n) == "trainer"], path


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_imports_experiments(package: str) -> None:
    for path in modules(package):
        assert not [n for n in imports_of(path) if top(n) == "experiments"], path


@pytest.mark.parametrize("path", modules("trainer"), ids=lambda p: str(p.relative_to(ROOT)))
def test_trainer_does_not_import_qkwatch(path: Path) -> None:
    assert not [n for n in imports_of(path) if top(n) == "qkwatch"], f"{path.relative_to(ROOT)} imports qkwatch"


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from a import b`` counts ``a.b`` when that is a module)."""
    paths = {module_name(p): p for package in PACKAGES for p in modules(package)}
    return {name: {n for n in imports_of(path, main_block=False) if n in paths and n != name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]``, or None (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_does_not_import_tests(path: Path) -> None:
    assert not [n for n in imports_of(path) if top(n) == "tests"], f"{path.relative_to(ROOT)} imports tests"


def test_monitor_loads_without_torch_at_runtime() -> None:
    """Transitive imports too: importing every monitor module must not pull torch in."""
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in modules("monitor")]
    names = [n.removesuffix(".__init__") for n in names]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'agent', 'trainer', 'qkwatch'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
