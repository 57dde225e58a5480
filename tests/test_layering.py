"""The import directions of DESIGN.md and STYLE.md, held by a test.

* ``monitor`` never imports torch, ``agent`` or ``trainer`` (a collector host needs no torch).
* ``agent`` imports from ``monitor`` only its pure modules, the wire schema and the schedule
  formula, and never ``trainer``.
* ``agent.metrics`` is pure math: tensors in, tensors out; no threads, sockets, files or hooks.
* nothing imports ``trainer`` but ``trainer`` itself and the top-level ``qkwatch`` glue.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", modules("monitor"), ids=lambda p: str(p.relative_to(ROOT)))
def test_monitor_imports_no_torch_agent_or_trainer(path: Path) -> None:
    bad = [n for n in imports_of(path) if top(n) in {"torch", "agent", "trainer", "numpy", "safetensors"}]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", modules("agent"), ids=lambda p: str(p.relative_to(ROOT)))
def test_agent_imports_only_pure_monitor_modules(path: Path) -> None:
    names = imports_of(path)
    assert not [n for n in names if top(n) == "trainer"], f"{path.relative_to(ROOT)} imports trainer"
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


def test_monitor_loads_without_torch_at_runtime() -> None:
    """Transitive imports too: importing every monitor module must not pull torch in."""
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in modules("monitor")]
    names = [n.removesuffix(".__init__") for n in names]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'agent', 'trainer'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
