"""Red team, rules files (issue 34): what a hostile or careless rules file does to ``qkwatch alerts backtest``
and ``qkwatch serve --rules``.

Each file below is refused with one line naming the problem, exit status 2, no traceback, in bounded
time (a 30 s timeout) and memory (the process runs under a 1.5 GiB address-space limit: the alias bomb
below would need far more if it were expanded). The file is checked before any collector is asked
(the backtest's URL here refuses connections, so a file that passed would fail differently).
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live import free_port

BOMB = "\n".join(
    ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    + ["rules: [*a8]"]
)
FILES = {
    "alias bomb": (BOMB, "anchors and aliases are not allowed"),
    "huge float": (
        'rules:\n  - {name: x, metric: qkai, op: ">", threshold: 1e999}',
        "threshold must be a finite number",
    ),
    "NaN threshold": (
        'rules:\n  - {name: x, metric: qkai, op: ">", threshold: .nan}',
        "threshold must be a finite number",
    ),
    "inf threshold": (
        'rules:\n  - {name: x, metric: qkai, op: ">", threshold: -.inf}',
        "threshold must be a finite number",
    ),
    "huge integer": (
        'rules:\n  - {name: x, metric: qkai, op: ">", threshold: ' + "9" * 5000 + "}",
        "a number too long to read",
    ),
    "huge count": ('rules:\n  - {name: x, metric: qkai, op: ">", for_reports: ' + "9" * 30 + "}", "from 1 to 10000"),
    "unknown kind": ("rules:\n  - {name: x, kind: teleport, metric: qkai}", "kind must be one of"),
    "a million rules": (
        "rules:\n" + "".join(f"  - {{name: r{i}, metric: qkai, op: '>', threshold: 0.5}}\n" for i in range(1_000_000)),
        "a rules file is at most 1048576",
    ),
    "many small rules": (
        "rules:\n" + "".join(f"  - {{name: r{i}, metric: qkai}}\n" for i in range(2000)),
        "a rules file holds at most 1000",
    ),
    "markup in a name": (
        'rules:\n  - {name: "<img src=x onerror=alert(1)>", metric: qkai}',
        "name must be a name of letters",
    ),
    "not a rules file": ("root:x:0:0:root:/root:/bin/bash\n", "must be a mapping with 'rules'"),
}


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))  # 1.5 GiB


def backtest(rules: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the file must be refused first
    return subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "alerts", "backtest", "any/run", "--rules", str(rules), "--url", url],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=limited,
    )


@pytest.mark.parametrize("name", list(FILES))
def test_a_hostile_rules_file_is_one_line_exit_2_in_bounded_time_and_memory(name: str, tmp_path: Path) -> None:
    text, expected = FILES[name]
    path = tmp_path / "rules.yml"
    path.write_text(text)
    done = backtest(path, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert expected in done.stderr, done.stderr
    assert done.stderr.startswith(f"qkwatch alerts backtest: rules file {path}: ")


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc", "../../../nonexistent/rules.yml"])
def test_a_path_outside_the_working_directory_is_read_as_any_other_and_refused_in_one_line(
    path: str, tmp_path: Path
) -> None:
    """The user's own command may name any file they can read; what is not a rules file is refused
    in one line, whatever it is (a system file, a folder, nothing)."""
    done = backtest(path, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_serve_refuses_the_same_files_before_it_listens(tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(BOMB)
    database = f"sqlite:///{tmp_path / 'c.db'}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qkwatch.cli",
            "serve",
            "--port",
            str(free_port()),
            "--rules",
            str(path),
            "--database-url",
            database,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited,
    )
    assert done.returncode == 2 and "anchors and aliases are not allowed" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
