"""The CLI explains itself: every subcommand and option has help text, help reads as plain text, the
README documents ``runs``, ``alerts`` and ``report``; and ``runs``/``alerts`` against a real collector
take a run by ``project/name`` and search runs."""

from __future__ import annotations

import argparse
import json
import re
import uuid
from pathlib import Path

import pytest

from qkwatch.cli import build_parser, main
from tests.monitor.conftest import report

README = Path(__file__).resolve().parents[2] / "README.md"


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, subcommand or option, help) of every subcommand and option under ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield path, name, helps.get(name)
                yield from walk(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, "/".join(action.option_strings) or action.dest, action.help


def test_every_subcommand_and_option_has_help():
    missing = [
        f"qkwatch {' '.join(path)} {what}"
        for path, what, text in walk(build_parser())
        if not text or text == argparse.SUPPRESS
    ]
    assert missing == []


def test_the_named_options_say_what_they_do():
    helps = {(path, what): text for path, what, text in walk(build_parser())}
    for key in (
        (("serve",), "--host"),
        (("serve",), "--port"),
        (("alerts",), "--run"),
        (("alerts",), "--state"),
        (("alerts",), "--json"),
        (("runs", "show"), "run"),
        (("runs", "delete"), "run"),
    ):
        assert len(helps[key]) > 10, key
    assert "project/name" in helps[(("alerts",), "--run")] and "project/name" in helps[(("runs", "show"), "run")]


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "--help"],
        ["demo", "--help"],
        ["serve", "--help"],
        ["alerts", "--help"],
        ["runs", "list", "--help"],
        ["report", "--help"],
    ],
)
def test_help_is_plain_text_and_lists_every_action(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out
    if argv[0] == "runs" and len(argv) == 2:
        assert re.search(r"^\s+list\s+\S", out, re.M) and re.search(r"^\s+show\s+\S", out, re.M)


def test_the_readme_documents_runs_alerts_and_report():
    """The README's quickstart and the collector's page of the docs site between them."""
    text = README.read_text() + (README.parent / "docs" / "collector.md").read_text()
    for command in (
        "qkwatch runs list",
        "qkwatch runs show",
        "qkwatch runs delete",
        "qkwatch runs tag",
        "qkwatch runs untag",
        "qkwatch runs note",
        "qkwatch alerts",
        "qkwatch report",
    ):
        assert f"{command} " in text, command
    for option in ("--qkai-above", "--collapse-band", "--state", "project/name", "--tag"):
        assert option in text, option


def test_runs_and_alerts_take_project_slash_name_and_search(collector, capsys):
    url = collector.start().url
    project = f"cli-{uuid.uuid4().hex[:6]}"
    with collector.client() as c:
        calm = c.create_run(project, "calm")
        band = c.create_run(project, "band")
        c.send_reports(calm, [report(s, {"qkai": [0.2, 0.2, 0.2]}) for s in range(3)])
        c.send_reports(band, [report(s, {"qkai": [0.9, 0.9, 0.9]}) for s in range(3)])
    assert main(["runs", "show", f"{project}/band", "--url", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["run"]["id"] == band.id and shown["run"]["created_at_iso"] and len(shown["alerts"]) == 4
    assert main(["alerts", "--run", f"{project}/calm", "--url", url]) == 0
    (header,) = capsys.readouterr().out.splitlines()  # no alerts: the header alone
    assert header.split()[:4] == ["state", "severity", "run", "rule"]
    assert main(["alerts", "--run", f"{project}/band", "--state", "firing", "--url", url]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("state") and len(lines) == 4 and all(f"{project}/band" in line for line in lines)
    assert main(["runs", "list", "--project", project, "--qkai-above", "0.7", "--url", url]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert re.split(r"\s{2,}", header) == ["id", "run", "status", "attempt", "last step", "updated (UTC)", "tags"]
    assert re.split(r"\s{2,}", line)[:5] == [band.id, f"{project}/band", "running", "1", "2"] and " 20" in line
    assert main(["runs", "list", "--project", project, "--no-collapse-band", "--json", "--url", url]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)["data"]] == ["calm"]
    assert main(["runs", "show", f"{project}/nope", "--url", url]) == 1
    assert "not found" in capsys.readouterr().err
