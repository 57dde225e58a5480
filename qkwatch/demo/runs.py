"""What the demos share: where their collector listens, and one training subprocess reporting to it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROJECT = "demo"
PROGRESS_SECONDS = 15.0
DEFAULT_PORT = 8000
"""Where the demo's collector listens, unless the port is taken (then the next free one); also the
default URL of the CLI and the client, so the commands need no ``--url`` there."""


@dataclass
class Trainee:
    """One training subprocess of the demo."""

    variant: str
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    run_id: str | None = None


def start_run(variant: str, name: str, recipe: str, overrides: list[str], url: str, workdir: Path) -> Trainee:
    """One training of ``recipe`` with ``overrides``, reporting as ``demo/<name>`` to the collector at ``url``."""
    # The collector has no run of this name (run_names), so its checkpoints and spool here, if any,
    # are left from a database since deleted: the trainer would refuse them, the agent replay them.
    for stale in (workdir / "runs" / name, workdir / "spool" / PROJECT / name):
        shutil.rmtree(stale, ignore_errors=True)
    env = {
        **os.environ,
        "QKWATCH_URL": url,
        "QKWATCH_PROJECT": PROJECT,
        "QKWATCH_RUN": name,
        "QKWATCH_SPOOL": str(workdir / "spool"),
    }
    sets = [item for kv in overrides for item in ("--set", kv)]
    log = workdir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "qkwatch.cli",
        "train",
        "--recipe",
        recipe,
        "--out",
        str(workdir / "runs" / name),
        *sets,
    ]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Trainee(variant, name, process, log)


def commands() -> tuple[str, str]:
    """The ``qkwatch`` command and the Python of this installation, as a shell here takes them
    (``.venv/bin/qkwatch`` from the repository root: nothing asks for the venv to be activated)."""
    python = Path(sys.executable)  # .venv/bin/python3 under the script's shebang; a venv has .venv/bin/python too
    python = python.with_name("python") if python.with_name("python").is_file() else python
    script = python.with_name("qkwatch")
    qkwatch = shown(script) if script.is_file() else f"{shown(python)} -m qkwatch.cli"
    return qkwatch, shown(python)


def shown(path: Path, quote: bool = True) -> str:
    """``path`` relative to the working directory when it lies below it (absolute otherwise), for a shell."""
    try:
        text = str(path.relative_to(Path.cwd()))
    except ValueError:
        text = str(path)
    return shlex.quote(text) if quote else text
