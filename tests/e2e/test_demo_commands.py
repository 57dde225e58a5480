"""What ``qkwatch demo`` leaves queryable, in seconds: the names a rerun gives its runs, the port it
picks, and the commands it prints while it serves, run as printed against a real ``qkwatch serve``
holding runs made to order. ``test_demo.py`` (slow) runs the same commands after the whole demo."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from qkwatch.demo import queryable, run_names
from qkwatch.launch import HOST, first_free_port, free_port, port_is_free
from tests.live import LiveCollector
from tests.monitor.ui.runs import seed


def test_a_rerun_numbers_its_runs(collector: LiveCollector) -> None:
    collector.start()
    with collector.client() as client:
        assert run_names(client) == {"vanilla": "vanilla", "raa": "raa"}
        seed(client)  # demo/vanilla and demo/raa: an earlier demo
        assert run_names(client) == {"vanilla": "vanilla-2", "raa": "raa-2"}
        client.create_run("demo", "raa-2", {})  # half a pair is taken too
        assert run_names(client) == {"vanilla": "vanilla-3", "raa": "raa-3"}


def test_the_printed_commands_work_as_printed(collector: LiveCollector, tmp_path: Path) -> None:
    collector.start()
    with collector.client() as client:
        vanilla, raa = seed(client)
    printed = queryable(collector.url, {"vanilla": "vanilla", "raa": "raa"}, [vanilla["id"], raa["id"]], tmp_path)
    assert f"live page:  {collector.url}/?run={vanilla['id']}&run={raa['id']}" in printed
    outputs = run_printed(printed, cwd=Path.cwd())
    assert re.search(r"\sdemo/vanilla\s", outputs[0]) and re.search(r"\sdemo/raa\s", outputs[0]), outputs[0]
    assert '"name": "vanilla"' in outputs[1] and '"project": "demo"' in outputs[1]
    assert (tmp_path / "report.html").stat().st_size > 100_000  # plotly.js is inlined
    assert "'demo/vanilla'" in outputs[3] and "'demo/raa'" in outputs[3]


def test_the_commands_name_the_collector_unless_it_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QKWATCH_URL", raising=False)
    names = {"vanilla": "vanilla", "raa": "raa"}
    at_default = queryable("http://127.0.0.1:8000", names, ["a", "b"], Path(".qkwatch/demo"))
    assert "--url" not in at_default and 'qkwatch.Client("http://127.0.0.1:8000")' in at_default
    elsewhere = queryable("http://127.0.0.1:8001", names, ["a", "b"], Path(".qkwatch/demo"))
    assert len(re.findall(r" --url http://127\.0\.0\.1:8001$", elsewhere, re.M)) == 3, elsewhere
    monkeypatch.setenv("QKWATCH_URL", "http://collector.example:8000")  # this shell points elsewhere
    assert queryable("http://127.0.0.1:8000", names, ["a", "b"], Path(".qkwatch/demo")).count("--url") == 3


def test_the_port_is_the_first_free_one_from_8000() -> None:
    port = free_port()
    with socket.socket() as server:
        server.bind((HOST, port))
        server.listen()
        assert not port_is_free(port)
        taken = first_free_port(port)
        assert taken != port and port_is_free(taken)
    assert first_free_port(port) == port


def run_printed(printed: str, cwd: Path) -> list[str]:
    """Run each command of the demo's serving lines in a shell, as a user pastes them, and the client
    snippet with the Python it names; their outputs, in order. Nothing of this shell's collector
    settings reaches them: the commands must carry what they need."""
    env = {k: v for k, v in os.environ.items() if k not in ("QKWATCH_URL", "QKWATCH_TOKEN")}
    commands = re.findall(r"^  (\S+ (?:runs|report) .*)$", printed, re.M)
    assert len(commands) == 3, printed
    python = re.search(r"^  (\S+), then:$", printed, re.M)
    snippet = re.findall(r"^    (.*)$", printed, re.M)
    assert python and len(snippet) == 3, printed
    commands.append(f"{python.group(1)} -c {shlex.quote(chr(10).join(snippet))}")
    runs = [
        subprocess.run(c, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=120) for c in commands
    ]
    for command, done in zip(commands, runs, strict=True):
        assert done.returncode == 0, f"{command}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return [done.stdout for done in runs]
