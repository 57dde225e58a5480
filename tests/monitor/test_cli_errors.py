"""No traceback from any ``qkwatch`` command given a bad port, database URL, setting or collector URL: one
line on stderr naming the problem and exit status 2, before the command does anything (issue 21, L3).
Each command runs as a real subprocess of this checkout; a collector that is merely unreachable stays
exit status 1 (the documented answer of the client commands)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.live import ROOT, free_port

pytestmark = pytest.mark.slow

UNREACHABLE_PG = "postgresql+psycopg://postgres@127.0.0.1:1/x"
"""Nothing listens on port 1: the connection is refused at once."""
BIG = "1" * 401


def qkwatch(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_clean_environ(), **(env or {})},
    )


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("QKWATCH_")}


def refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``qkwatch ARGS`` expecting exit status 2, one line on stderr and no traceback; returns the line."""
    done = qkwatch(*args, env=env)
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert "listening" not in done.stdout, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


# --- qkwatch serve ------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_serve_refuses_a_port_out_of_range(tmp_path: Path, port: str):
    line = refused("serve", "--port", port, "--database-url", f"sqlite:///{tmp_path / 'x.db'}")
    assert line.startswith("qkwatch serve: --port") and port in line and "65535" in line, line
    assert not (tmp_path / "x.db").exists()  # refused before the database is touched


def test_serve_refuses_a_port_in_use(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused("serve", "--port", str(port), "--database-url", f"sqlite:///{tmp_path / 'x.db'}")
    assert line.startswith("qkwatch serve: cannot listen on") and f"127.0.0.1:{port}" in line, line
    assert "in use" in line, line


def test_serve_refuses_zero_workers(tmp_path: Path):
    line = refused("serve", "--workers", "0", "--port", str(free_port()), "--database-url", f"sqlite:///{tmp_path}/x")
    assert "--workers 0" in line, line


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("QKWATCH_COLLAPSE_THRESHOLD", "nan"),
        ("QKWATCH_WEBHOOK_URLS", "ftp://x"),
        ("QKWATCH_RATE_LIMIT_PER_S", "inf"),
        ("QKWATCH_DATABASE_URL", ""),
    ],
)
def test_serve_refuses_a_bad_setting_naming_the_variable_and_the_value(tmp_path: Path, variable: str, value: str):
    """Every setting's bad values: tests/monitor/test_settings.py; here, that serve says so in one line."""
    args = ["serve", "--port", str(free_port())]
    if variable != "QKWATCH_DATABASE_URL":
        args += ["--database-url", f"sqlite:///{tmp_path / 'x.db'}"]
    line = refused(*args, env={variable: value})
    assert line.startswith(f"qkwatch serve: setting {variable}={value!r}: "), line


def test_serve_refuses_a_rules_file_with_an_integer_too_large_for_a_float(tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"rules:\n  - {{name: r, metric: qkai, op: '>', threshold: {BIG}, for_reports: 2}}\n")
    line = refused(
        "serve", "--port", str(free_port()), "--database-url", f"sqlite:///{tmp_path}/x.db", "--rules", str(rules)
    )
    assert "rule 'r': threshold must be a finite number" in line, line


def test_serve_names_where_a_bad_database_url_came_from(tmp_path: Path):
    line = refused(
        "serve", "--port", str(free_port()), env={"QKWATCH_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/x"}
    )
    assert "(QKWATCH_DATABASE_URL)" in line and "127.0.0.1" in line and "hunter2" not in line, line


# --- qkwatch db and qkwatch token ---------------------------------------------------------------

BAD_DATABASES = {
    "unknown": ("notadb://nowhere", "unsupported database 'notadb'"),
    "unreachable-pg": (UNREACHABLE_PG, "127.0.0.1"),
    "password": ("postgresql://postgres:hunter2@127.0.0.1:1/x", "postgres:***@127.0.0.1"),
    "missing-dir": ("sqlite:////nonexistent-dir/sub/x.db", "/nonexistent-dir/sub/x.db"),
    "empty": ("", "--database-url='': is empty"),
}
TOKEN = ["token", "create", "--project", "p", "--scope", "read"]


@pytest.mark.parametrize(
    ("command", "database"),
    [(["db", "upgrade"], name) for name in BAD_DATABASES]
    + [(TOKEN, "unreachable-pg"), (["token", "list"], "missing-dir"), (["token", "revoke", "0123"], "password")],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_database_commands_refuse_a_bad_database_in_one_line(command: list[str], database: str):
    url, expect = BAD_DATABASES[database]
    line = refused(*command, "--database-url", url)
    assert line.startswith(f"qkwatch {' '.join(command[:2])}:"), line
    assert expect in line and "hunter2" not in line, line


@pytest.mark.parametrize("command", [["db", "upgrade"], TOKEN], ids=" ".join)
def test_database_commands_refuse_a_bad_setting_in_one_line(tmp_path: Path, command: list[str]):
    line = refused(*command, "--database-url", f"sqlite:///{tmp_path / 'x.db'}", env={"QKWATCH_H_STAR": "inf"})
    assert "setting QKWATCH_H_STAR='inf'" in line, line
    assert not (tmp_path / "x.db").exists()


def test_a_database_url_from_the_environment_is_named_as_such():
    line = refused("token", "list", env={"QKWATCH_DATABASE_URL": UNREACHABLE_PG})
    assert "(QKWATCH_DATABASE_URL)" in line and "connection" in line.lower(), line


def test_db_upgrade_still_migrates_a_good_database(isolated_db_url: str):
    done = qkwatch("db", "upgrade", "--database-url", isolated_db_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is up to date" in done.stdout and "Traceback" not in done.stderr


# --- the container's start-up -------------------------------------------------------------------


def _dockerfile_start_up() -> str:
    """The collector image's ``CMD`` (``sh -c "qkwatch db upgrade && exec qkwatch serve ..."``), with
    ``qkwatch`` running this checkout."""
    cmd = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    argv = json.loads(cmd.removeprefix("CMD "))
    assert argv[:2] == ["sh", "-c"] and argv[2].startswith("qkwatch db upgrade && "), argv
    here = f"{shlex.quote(sys.executable)} -m qkwatch.cli"
    return re.sub(r"\bqkwatch (?=db|serve)", f"{here} ", argv[2])


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({"QKWATCH_DATABASE_URL": "postgresql://qkwatch:s3cret@127.0.0.1:1/qkwatch"}, "cannot use the database"),
        ({"QKWATCH_DATABASE_URL": "sqlite:///x.db", "QKWATCH_COLLAPSE_THRESHOLD": "nan"}, "COLLAPSE_THRESHOLD"),
    ],
)
def test_the_container_start_up_fails_in_one_line_at_db_upgrade(tmp_path: Path, env: dict[str, str], expect: str):
    done = subprocess.run(
        ["sh", "-c", _dockerfile_start_up()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**_clean_environ(), "PYTHONPATH": str(ROOT), **env},
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkwatch db upgrade:") and expect in lines[0], done.stderr[-3000:]
    assert "s3cret" not in done.stderr and "listening" not in done.stdout


# --- client commands ----------------------------------------------------------------------------

CLIENT_COMMANDS = [
    ["runs", "list"],
    ["runs", "show", "p/r"],
    ["runs", "tag", "p/r", "t"],
    ["runs", "note", "p/r", "x"],
    ["runs", "delete", "p/r", "--yes"],
    ["alerts"],
    ["alerts", "backtest", "p/r"],
    ["report", "p/r", "--out", "x.html"],
]


BAD_URLS = ["http://127.0.0.1:70000", "ftp://collector.example", "collector.example"]


@pytest.mark.parametrize(
    ("command", "url"), [(c, BAD_URLS[i % len(BAD_URLS)]) for i, c in enumerate(CLIENT_COMMANDS)], ids=str
)
def test_client_commands_refuse_a_bad_collector_url_in_one_line(command: list[str], url: str):
    line = refused(*command, "--url", url)
    assert line.startswith("qkwatch ") and "--url" in line and url in line, line


def test_a_bad_collector_url_from_the_environment_is_refused_too():
    line = refused("runs", "list", env={"QKWATCH_URL": "http://127.0.0.1:99999"})
    assert "QKWATCH_URL" in line and "99999" in line, line


def test_a_token_that_cannot_be_sent_is_refused_in_one_line():
    line = refused("alerts", "--url", "http://127.0.0.1:1", env={"QKWATCH_TOKEN": "abc\ndef"})
    assert "QKWATCH_TOKEN" in line, line


@pytest.mark.parametrize("command", CLIENT_COMMANDS[::2], ids=" ".join)
def test_client_commands_against_an_unreachable_collector_say_so_in_one_line(command: list[str]):
    done = qkwatch(*command, "--url", "http://127.0.0.1:1")
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the collector at http://127.0.0.1:1" in lines[0], done.stderr
