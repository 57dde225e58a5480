"""The import directions of docs/architecture.md, held by a test.

One real package, ``qkwatch/``, with no links in it: ``qkwatch.agent``, ``qkwatch.monitor``,
``qkwatch.trainer``, ``qkwatch.dashboards``, ``qkwatch.integrations`` and ``qkwatch.contract`` are
folders inside it, and a file is importable under one name only. The rules:

* nothing imports a bare ``agent``, ``monitor``, ``trainer`` or ``dashboards`` (``import agent``
  fails: only ``qkwatch`` is installed), and the tree holds no symbolic link.
* ``qkwatch.contract`` (the wire format, metric names, thresholds, the schedule) imports only the
  standard library, pydantic and itself. The agent and the collector meet there and nowhere else:
  ``qkwatch.agent`` never imports ``qkwatch.monitor``, and ``qkwatch.monitor`` never imports the
  agent; ``import qkwatch.agent`` (every module of it) loads neither fastapi nor sqlalchemy.
* ``qkwatch.rules`` (the alert rules as pure functions) imports only the contract, numpy, PyYAML and itself;
  the collector evaluates them, and ``qkwatch.client``'s backtest replays through them.
* ``qkwatch.client`` (the REST client, the report, the backtest) imports the contract and the
  rules, never the monitor, the agent, the trainer or the dashboards: a training environment
  reads the collector through it without the collector's libraries.
* ``qkwatch.monitor`` (the service alone) never imports torch, safetensors or any other ``qkwatch``
  package but the contract and the rules (a collector host needs no torch). numpy it may: it is one
  of the package's own dependencies (``GET /history`` writes its JSON from a numpy view of the stored doubles). Inside
  it, ``alerting`` never imports ``store``, ``api``, ``ui`` or ``main`` (the store calls the rules,
  not the other way round), and ``store`` never imports ``api``, ``ui`` or ``main``.
* ``qkwatch.agent`` imports the contract, and never the monitor, the trainer, the dashboards or
  the top-level glue.
* ``qkwatch.agent.metrics`` is pure math: tensors in, tensors out; no threads, sockets, files or hooks.
* ``qkwatch.trainer`` meets the agent through its public API only: the ``qkwatch.agent`` package
  itself and the geometry functions of ``qkwatch.agent.metrics``. It does not import the glue.
  Only its seam, ``qkwatch.trainer.reporting.monitoring``, imports the ``qkwatch.agent`` package itself.
* nothing imports ``qkwatch.trainer`` but the trainer itself and the glue (the ``qkwatch`` command).
* ``qkwatch.dashboards`` (generators of the Grafana and Prometheus files, and the Grafana push) may
  read the monitor, the rules and the contract; nothing of the agent, the monitor or the trainer
  imports it.
* the command line's modules (``qkwatch/cli.py``, ``qkwatch.commands``) and the demo (``qkwatch.demo``)
  are glue: they may import every part; no part imports them.
* the glue's framework integrations (``qkwatch.integrations``) and ``qkwatch.raa`` are imported by
  nothing in the agent, the monitor or the trainer; they meet the agent through its public API.
* no two modules of ours import each other, directly or around a circle (imports inside functions
  count; so does a script's ``if __name__ == "__main__":`` block): in the package, and among the
  modules of ``experiments/`` and ``bench/``.
* ``bench/`` and ``experiments/`` import nothing from ``tests/``, never patch ``sys.path`` (they run
  as modules, ``python -m bench.ingest``), and no package imports them; nor do the scripts of
  ``examples/`` (run as files, ``python examples/hf_trainer.py``, they ``import qkwatch``).
* no module of the package is longer than :data:`MAX_LINES` lines, and no module of ``experiments/``
  or ``bench/`` longer than :data:`SCRIPT_MAX_LINES`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "qkwatch.agent",
    "qkwatch.monitor",
    "qkwatch.trainer",
    "qkwatch.contract",
    "qkwatch.dashboards",
    "qkwatch.client",
    "qkwatch.rules",
)
"""The parts of the package that are folders of their own (beside the glue)."""
GLUE = "qkwatch"
"""The top-level package's own modules (``qkwatch/*.py``, ``qkwatch/integrations/`` and ``qkwatch/demo/``): the
command line, the demo, the launcher, RAA for any loop, the framework integrations."""
INTEGRATIONS = "qkwatch.integrations"
CONTRACT = "qkwatch.contract"
MAX_LINES = 400
"""The longest a module of the package may be (one concept a module)."""
SCRIPT_MAX_LINES = 400
"""The longest a module of ``experiments/`` or ``bench/`` may be."""
AGENT_PUBLIC = {"qkwatch.agent", "qkwatch.agent.metrics"}
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
    """Every absolute import of ``path``: ``module`` and ``module.name`` for ``from module import name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def relative_imports(path: Path) -> list[int]:
    """Line numbers of ``from . import x`` style imports (the tree uses absolute imports only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]


def glue_modules() -> dict[str, Path]:
    files = [
        *(ROOT / "qkwatch").glob("*.py"),
        *(ROOT / "qkwatch" / "integrations").rglob("*.py"),
        *(ROOT / "qkwatch" / "commands").rglob("*.py"),
        *(ROOT / "qkwatch" / "demo").rglob("*.py"),
    ]
    return {module_of(p): p for p in sorted(files)}


def module_of(path: Path) -> str:
    """``qkwatch/agent/probe/probe.py`` -> ``qkwatch.agent.probe.probe``; ``qkwatch/cli.py`` -> ``qkwatch.cli``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules(package: str) -> dict[str, Path]:
    """Module name -> file, for one of our packages (``qkwatch.agent``, or a subpackage of it)."""
    folder = ROOT.joinpath(*package.split("."))
    return {module_of(p): p for p in sorted(folder.rglob("*.py"))}


def ours() -> dict[str, Path]:
    return {module_of(p): p for p in sorted((ROOT / GLUE).rglob("*.py"))}


def script_modules() -> dict[str, Path]:
    """Module name -> file, for ``experiments/`` and ``bench/`` (``bench/fleet/agents.py``: ``bench.fleet.agents``)."""
    return {module_of(p): p for folder in ("experiments", "bench") for p in sorted((ROOT / folder).rglob("*.py"))}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def cases(found: dict[str, Path]) -> list[object]:
    """``(name, path)`` parameters, each named by its module."""
    return [pytest.param(name, path, id=name) for name, path in found.items()]


def python_files() -> list[Path]:
    """Every Python file of the repository: packages, tests, bench, experiments, dashboards."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in tracked.stdout.split()]


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_imports_a_bare_top_level_package(path: Path) -> None:
    bare = [n for n in imports_of(path) if n.split(".")[0] in {"agent", "monitor", "trainer", "dashboards"}]
    assert not bare, f"{path.relative_to(ROOT)} imports {bare}: write qkwatch.{bare[0]}"
    assert not relative_imports(path), (
        f"{path.relative_to(ROOT)} has relative imports on lines {relative_imports(path)}"
    )


@pytest.mark.parametrize(("name", "path"), cases(modules(CONTRACT)))
def test_the_contract_imports_only_the_standard_library_and_pydantic(name: str, path: Path) -> None:
    names = imports_of(path)
    foreign = [n for n in names if within(n, GLUE) and not within(n, CONTRACT)]
    third = [n for n in names if n.split(".")[0] not in (*sys.stdlib_module_names, "pydantic", GLUE, "__future__")]
    assert not foreign and not third, f"{name} imports {foreign + third}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.monitor")))
def test_monitor_imports_no_torch_and_no_other_package(name: str, path: Path) -> None:
    names = imports_of(path)
    bad = [n for n in names if n.split(".")[0] in {"torch", "safetensors"}]
    allowed = ("qkwatch.monitor", CONTRACT, "qkwatch.rules")
    bad += [n for n in names if within(n, GLUE) and not any(within(n, a) for a in allowed)]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.rules")))
def test_the_rules_import_only_the_contract(name: str, path: Path) -> None:
    names = imports_of(path)
    bad = [n for n in names if within(n, GLUE) and not within(n, "qkwatch.rules") and not within(n, CONTRACT)]
    base = (*sys.stdlib_module_names, "numpy", "yaml", GLUE, "__future__")  # base dependencies only
    third = [n for n in names if n.split(".")[0] not in base]
    assert not bad and not third, f"{name} imports {bad + third}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.client")))
def test_the_client_imports_the_contract_and_the_rules_only(name: str, path: Path) -> None:
    allowed = ("qkwatch.client", CONTRACT, "qkwatch.rules")
    bad = [n for n in imports_of(path) if within(n, GLUE) and not any(within(n, a) for a in allowed)]
    assert not bad, f"{name} imports {bad}"


def test_importing_the_client_loads_no_collector_library() -> None:
    """Every module of ``qkwatch.client``, imported in a fresh interpreter: no fastapi, sqlalchemy,
    starlette, uvicorn or alembic is loaded, and no module of ``qkwatch.monitor``."""
    names = list(modules("qkwatch.client"))
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "             ('fastapi', 'sqlalchemy', 'starlette', 'uvicorn', 'alembic', 'torch')\n"
        "             or m.startswith('qkwatch.monitor'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(("name", "path"), cases({n: p for package in PACKAGES for n, p in modules(package).items()}))
def test_no_part_imports_the_command_line(name: str, path: Path) -> None:
    bad = [
        n for n in imports_of(path) if within(n, "qkwatch.commands") or within(n, "qkwatch.demo") or n == "qkwatch.cli"
    ]
    assert not bad, f"{name} imports {bad}: the command line and the demo sit on top"


LOWER_MONITOR_LAYERS = {
    "qkwatch.monitor.alerting": (
        "qkwatch.monitor.store",
        "qkwatch.monitor.api",
        "qkwatch.monitor.ui",
        "qkwatch.monitor.main",
    ),
    "qkwatch.monitor.store": ("qkwatch.monitor.api", "qkwatch.monitor.ui", "qkwatch.monitor.main"),
}


@pytest.mark.parametrize("layer", LOWER_MONITOR_LAYERS)
def test_monitor_layers_import_only_downward(layer: str) -> None:
    above = LOWER_MONITOR_LAYERS[layer]
    for name, path in modules(layer).items():
        upward = [n for n in imports_of(path) if any(within(n, a) for a in above)]
        assert not upward, f"{name} imports {upward}, which sit above {layer}"


TRAINER_FLOORS = ("reporting", "model", "checkpoints", "run")
"""The trainer's rooms from the ground floor up: the agent seam (``Monitor``, which RAA and the loop
talk to), the network, its checkpoints, and the run that uses them all."""


@pytest.mark.parametrize("room", TRAINER_FLOORS)
def test_trainer_rooms_import_only_downward(room: str) -> None:
    above = [f"qkwatch.trainer.{r}" for r in TRAINER_FLOORS[TRAINER_FLOORS.index(room) + 1 :]]
    found = modules(f"qkwatch.trainer.{room}")
    assert found, f"no modules in qkwatch.trainer.{room}"
    for name, path in found.items():
        upward = [n for n in imports_of(path) if any(within(n, a) for a in above)]
        assert not upward, f"{name} imports {upward}, which sit above qkwatch.trainer.{room}"


def test_the_trainer_has_only_its_floors_and_the_command_line() -> None:
    rooms = {p.name for p in (ROOT / "qkwatch" / "trainer").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(TRAINER_FLOORS), f"a trainer room without a floor: {sorted(rooms - set(TRAINER_FLOORS))}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.agent")))
def test_agent_imports_the_contract_and_never_the_monitor(name: str, path: Path) -> None:
    names = imports_of(path)
    upward = [n for n in names if within(n, "qkwatch.trainer") or n in glue_modules()]
    assert not upward, f"{name} imports {upward}"
    other = [n for n in names if within(n, "qkwatch.monitor") or within(n, "qkwatch.dashboards")]
    assert not other, f"{name} imports {other}: what the agent shares with the collector is in {CONTRACT}"


def test_importing_the_agent_loads_no_collector_library() -> None:
    """Every module of ``qkwatch.agent``, imported in a fresh interpreter: no fastapi, sqlalchemy,
    starlette, uvicorn, alembic or plotly is loaded, and no module of ``qkwatch.monitor``."""
    names = list(modules("qkwatch.agent"))
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "             ('fastapi', 'sqlalchemy', 'starlette', 'uvicorn', 'alembic', 'plotly')\n"
        "             or m.startswith('qkwatch.monitor'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("name", "path"), cases({n: p for pkg in ("qkwatch.agent", "qkwatch.trainer") for n, p in modules(pkg).items()})
)
def test_the_monitor_is_not_imported_by_the_agent_or_the_trainer_and_the_dashboards_by_nothing(
    name: str, path: Path
) -> None:
    bad = [n for n in imports_of(path) if within(n, "qkwatch.monitor") or within(n, "qkwatch.dashboards")]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.monitor")))
def test_the_monitor_imports_no_dashboards(name: str, path: Path) -> None:
    bad = [n for n in imports_of(path) if within(n, "qkwatch.dashboards")]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.agent.metrics")))
def test_metrics_are_pure(name: str, path: Path) -> None:
    names = imports_of(path)
    foreign = [n for n in names if within(n, GLUE) and not within(n, "qkwatch.agent.metrics")]
    impure = [n for n in names if n.split(".")[0] in IMPURE_FOR_METRICS]
    assert not foreign and not impure, f"{name} imports {foreign + impure}"


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.trainer")))
def test_trainer_meets_the_agent_through_its_public_api(name: str, path: Path) -> None:
    names = imports_of(path)
    agent = [n for n in names if within(n, "qkwatch.agent")]
    # ``from qkwatch.agent import attach`` gives "qkwatch.agent" and "qkwatch.agent.attach"
    private = [n for n in agent if n not in AGENT_PUBLIC and n.rsplit(".", 1)[0] not in AGENT_PUBLIC]
    assert not private, f"{name} reaches into the agent: {private}"
    glue = [n for n in names if n in glue_modules() and n != GLUE]
    assert not glue, f"{name} imports the glue {glue}"


TRAINER_SEAM = "qkwatch.trainer.reporting.monitoring"
"""The one trainer module that uses the agent's runtime; the others use only its geometry functions."""


@pytest.mark.parametrize(("name", "path"), cases(modules("qkwatch.trainer")))
def test_trainer_meets_the_agent_runtime_only_in_its_seam(name: str, path: Path) -> None:
    runtime = [n for n in imports_of(path) if within(n, "qkwatch.agent") and not within(n, "qkwatch.agent.metrics")]
    assert name == TRAINER_SEAM or not runtime, f"{name} imports {runtime}: go through {TRAINER_SEAM}"


@pytest.mark.parametrize("package", ["qkwatch.agent", "qkwatch.monitor"])
def test_nothing_imports_the_trainer(package: str) -> None:
    for name, path in modules(package).items():
        assert not [n for n in imports_of(path) if within(n, "qkwatch.trainer")], name


@pytest.mark.parametrize(("name", "path"), cases({n: p for package in PACKAGES for n, p in modules(package).items()}))
def test_no_package_imports_the_integrations_or_raa(name: str, path: Path) -> None:
    """They sit on top: the agent, the monitor and the trainer work without transformers or Lightning."""
    bad = [n for n in imports_of(path) if within(n, INTEGRATIONS) or within(n, "qkwatch.raa")]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize(
    ("name", "path"), cases({n: p for n, p in glue_modules().items() if within(n, INTEGRATIONS) or n == "qkwatch.raa"})
)
def test_the_integrations_and_raa_meet_the_agent_through_its_public_api(name: str, path: Path) -> None:
    agent = [n for n in imports_of(path) if within(n, "qkwatch.agent")]
    private = [n for n in agent if n not in AGENT_PUBLIC and n.rsplit(".", 1)[0] not in AGENT_PUBLIC]
    assert not private, f"{name} reaches into the agent: {private}"


@pytest.mark.parametrize(("name", "path"), cases(ours()))
def test_no_package_imports_bench_experiments_or_tests(name: str, path: Path) -> None:
    bad = [n for n in imports_of(path) if n.split(".")[0] in {"bench", "experiments", "tests"}]
    assert not bad, f"{name} imports {bad}"


SCRIPTS = sorted(
    [
        *(ROOT / "bench").glob("*.py"),
        *(ROOT / "experiments").rglob("*.py"),
        *(ROOT / "qkwatch" / "dashboards").rglob("*.py"),
        *(ROOT / "examples").glob("*.py"),
    ]
)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_run_as_modules_without_path_hacks(path: Path) -> None:
    assert not [n for n in imports_of(path) if n.split(".")[0] == "tests"], f"{path.relative_to(ROOT)} imports tests"
    tree = ast.parse(path.read_text())
    hacks = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]
    assert not hacks, f"{path.relative_to(ROOT)} touches sys.path on lines {hacks}"


def test_bench_modules_import_as_a_package_from_the_repository_root() -> None:
    """What ``python -m bench.<name>`` does first: every benchmark's imports resolve with no ``sys.path`` patch."""
    assert (ROOT / "bench" / "__init__.py").is_file(), "bench/ is a regular package"
    names = sorted(f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def import_graph(paths: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of ``paths`` (default: the package's) it imports (``from a import b`` counts
    ``a.b`` when that is a module).

    Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first, but those edges are
    Python's, not the code's: only what a file names counts.
    """
    paths = ours() if paths is None else paths
    return {name: {n for n in imports_of(path) if n in paths and n != name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]``, or None (depth-first search for a back edge)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("found", [ours, script_modules], ids=["qkwatch", "experiments-and-bench"])
def test_no_import_circles(found: Callable[[], dict[str, Path]]) -> None:
    cycle = find_cycle(import_graph(found()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_one_real_package_and_one_name_a_file() -> None:
    """No symbolic link in the tree (``git ls-files -s``: no mode 120000); the parts are folders of
    ``qkwatch/``; from the repository root ``import agent`` (or monitor, trainer, dashboards) fails."""
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000")]
    assert not links, f"symbolic links in the tree: {links}"
    for package in PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        assert folder.is_dir() and not folder.is_symlink() and (folder / "__init__.py").is_file(), folder
    code = (
        "import importlib\n"
        "for n in ('agent', 'monitor', 'trainer', 'dashboards'):\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'{n} imports as a top-level module')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert module_of(ROOT / "qkwatch" / "agent" / "metrics" / "__init__.py") == "qkwatch.agent.metrics"


@pytest.mark.parametrize(("name", "path"), cases(ours()))
def test_no_module_is_longer_than_the_limit(name: str, path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it along its seams"


@pytest.mark.parametrize(("name", "path"), cases(script_modules()))
def test_no_experiment_or_benchmark_is_longer_than_the_limit(name: str, path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= SCRIPT_MAX_LINES, f"{name} has {lines} lines (at most {SCRIPT_MAX_LINES}): split it by concept"


def test_monitor_and_the_package_load_without_torch_at_runtime() -> None:
    """Transitive imports too: ``import qkwatch`` and every monitor module must not pull torch in."""
    names = ["qkwatch", *modules("qkwatch.monitor")]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors')\n"
        "             or m.startswith(('qkwatch.agent', 'qkwatch.trainer')))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
