"""The built wheel, installed into a fresh virtual environment, is one package: ``qkwatch``.

The wheel is built from a copy of the working tree (the files git tracks, and new ones it does
not ignore), so the test sees what a ``pip install qkwatch`` would, and builds nothing into the
repository. The fresh environment gets the wheel from ``pip install --no-deps``; its dependencies
come from this test run's own environment, added as a plain path entry (a path entry's ``.pth``
files are not run, so the editable install of the repository stays out of it). That keeps the test
off the network; every ``qkwatch`` module it imports comes from the wheel, which it checks.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = ("agent", "monitor", "trainer", "dashboards")


def tree_files() -> list[str]:
    """What a build sees: tracked files and untracked ones git does not ignore (not deleted ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in listed.split("\0") if f and os.path.lexists(ROOT / f)]


def copy_tree(dest: Path) -> None:
    for name in tree_files():
        src, out = ROOT / name, dest / name
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    copy_tree(work / "src")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work / "dist"),
            str(work / "src"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = (work / "dist").glob("qkwatch-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = run(env, "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    # the dependencies (fastapi, sqlalchemy, torch, ...) from this environment, after the venv's own
    (Path(site) / "zz-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def run(env: Path, code: str) -> str:
    done = subprocess.run(
        [str(env / "bin" / "python"), "-c", code], cwd=env, capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def clean_env() -> dict[str, str]:
    """The environment without anything that would put the repository on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def test_the_wheel_holds_only_the_qkwatch_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"qkwatch", wheel.name.split("-py3")[0] + ".dist-info"}, sorted(tops)
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["qkwatch"]
    for needed in (
        "qkwatch/agent/metrics/subspace.py",
        "qkwatch/agent/shipping/disk_spool.py",
        "qkwatch/monitor/ui/page.html",
        "qkwatch/monitor/store/migrations/script.py.mako",
        "qkwatch/trainer/__main__.py",
        "qkwatch/monitor/store/migrations/versions/0001_initial_schema.py",
        "qkwatch/contract/wire.py",
        # the dashboards and rules, package data (what `qkwatch dashboards push` and the compose file read)
        "qkwatch/dashboards/grafana/dashboards/run.json",
        "qkwatch/dashboards/grafana/provisioning/dashboards/qkwatch.yml",
        "qkwatch/dashboards/grafana/postgres/10-qkwatch-grafana-role.sh",
        "qkwatch/dashboards/prometheus/rules/qkwatch.yml",
        "qkwatch/dashboards/prometheus/qkwatch.yml.template",
        "qkwatch/dashboards/rules/detectors.yml",
        "qkwatch/dashboards/alertmanager/alertmanager.yml",
    ):
        assert needed in names, needed


def test_import_qkwatch_comes_from_the_wheel_and_nothing_bare_is_installed(venv: Path) -> None:
    out = run(
        venv,
        (
            "import importlib.util, sys, qkwatch, qkwatch.agent, qkwatch.monitor.main, qkwatch.trainer.run.train\n"
            "import qkwatch.dashboards.generate\n"
            "print(qkwatch.__file__)\n"
            f"print([n for n in {BARE!r} if importlib.util.find_spec(n) is not None])\n"
            "print(qkwatch.attach.__module__, qkwatch.Client.__module__)\n"
            "print(sorted({m.__file__.split('/site-packages/')[0] for n, m in sys.modules.items()\n"
            "              if n.split('.')[0] == 'qkwatch' and getattr(m, '__file__', None)}))\n"
        ),
    ).splitlines()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert out[0] == str(site / "qkwatch" / "__init__.py")
    assert out[1] == "[]", f"top-level modules besides qkwatch are importable: {out[1]}"
    assert out[2] == "qkwatch.agent qkwatch.client.rest"
    assert out[3] == f"[{str(site.parent)!r}]", "some qkwatch module was imported from outside the wheel"


def test_the_installed_command_runs_help_and_a_migration(venv: Path, tmp_path: Path) -> None:
    qkwatch = str(venv / "bin" / "qkwatch")
    helped = subprocess.run(
        [qkwatch, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert helped.returncode == 0, helped.stderr[-3000:]
    for command in ("serve", "analyze", "train", "db", "report"):
        assert f"    {command}" in helped.stdout, helped.stdout
    db = tmp_path / "fresh.db"
    migrated = subprocess.run(
        [qkwatch, "db", "upgrade", "--database-url", f"sqlite:///{db}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    shipped = sorted(p.name for p in (ROOT / "qkwatch" / "monitor" / "store" / "migrations" / "versions").glob("0*.py"))
    with sqlite3.connect(db) as conn:
        (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert shipped[-1].startswith(revision), (revision, shipped[-1])
    assert {"runs", "points", "alerts", "tokens"} <= tables, tables


# --- the two install profiles ---------------------------------------------------------------------
#
# `pip install qkwatch` (the agent, the client, `qkwatch report` and `analyze`; the user brings torch)
# and `pip install 'qkwatch[collector]'`. Each profile's environment is the wheel installed with
# --no-deps plus exactly the distributions its requirements reach, resolved from the wheel's own
# METADATA and linked from this test run's environment (no network): what pip would install, minus
# the download.


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def closure(requirements: list[str], extras: set[str]) -> set[str]:
    """The distributions (canonical names) that ``qkwatch[extras]`` pulls in, transitively."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo: list[tuple[str, set[str]]] = [(r, extras) for r in requirements]
    while todo:
        text, wanted = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
            continue
        name = canonicalize_name(req.name)
        if name == "qkwatch":  # a self-reference: qkwatch[collector] inside another extra
            todo += [(r, set(req.extras)) for r in requirements]
            continue
        if name in found:
            continue
        found.add(name)
        todo += [(r, set(req.extras)) for r in metadata.distribution(name).requires or []]
    return found


def linked_site(names: set[str], dest: Path) -> Path:
    """A folder holding links to the files of the distributions ``names`` (from this environment)."""
    from importlib import metadata

    dest.mkdir(parents=True)
    for name in names:
        dist = metadata.distribution(name)
        root = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (dest / top).exists() and (root / top).exists():
                (dest / top).symlink_to(root / top)
    return dest


def profile_venv(wheel: Path, where: Path, extras: set[str], also: frozenset[str] | set[str] = frozenset()) -> Path:
    env = where / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    deps = linked_site(closure(wheel_requirements(wheel), extras) | set(also), where / "deps")
    site = run(env, "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    (Path(site) / "zz-profile-dependencies.pth").write_text(f"{deps}\n")
    return env


COLLECTOR_ONLY = ("fastapi", "sqlalchemy", "uvicorn", "alembic", "starlette", "prometheus_client")


def test_pip_install_qkwatch_trains_reads_and_reports_without_the_collector(wheel: Path, tmp_path: Path) -> None:
    """The base profile, with torch beside it (the user's): attach on a model, the client, the report
    and the rules import; no collector library is installed, and ``qkwatch serve`` says in one line
    which extra to install."""
    env = profile_venv(wheel, tmp_path, set(), also=closure(["torch"], set()))
    out = run(
        env,
        "import importlib.util, sys, torch, qkwatch\n"
        "from qkwatch.nanogpt import NanoGPT\n"
        "from qkwatch.client import Client\n"
        "import qkwatch.client.report, qkwatch.client.backtest, qkwatch.rules.evaluator\n"
        f"a = qkwatch.attach(NanoGPT(), project='p', run='r', spool={str(tmp_path / 'spool')!r})\n"
        "a.step(0); a.close(0)\n"
        f"print(sorted(n for n in {COLLECTOR_ONLY!r} if importlib.util.find_spec(n) is not None))\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {COLLECTOR_ONLY!r}))\n"
        "print(Client.__module__)\n",
    ).splitlines()
    assert out == ["[]", "[]", "qkwatch.client.rest"], out
    for command in (["serve"], ["db", "upgrade"], ["token", "list"]):
        done = subprocess.run(
            [str(env / "bin" / "qkwatch"), *command],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=clean_env(),
        )
        err = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
        assert "pip install 'qkwatch[collector]'" in err[0], err


def test_pip_install_qkwatch_collector_serves_without_torch(wheel: Path, tmp_path: Path) -> None:
    """The collector profile on a monitoring host: no torch, and the database migrates."""
    env = profile_venv(wheel, tmp_path, {"collector"})
    out = run(env, "import importlib.util, qkwatch.monitor.main\nprint(importlib.util.find_spec('torch'))\n")
    assert out.strip() == "None"
    db = tmp_path / "fresh.db"
    migrated = subprocess.run(
        [str(env / "bin" / "qkwatch"), "db", "upgrade", "--database-url", f"sqlite:///{db}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert migrated.returncode == 0, migrated.stderr[-3000:]
