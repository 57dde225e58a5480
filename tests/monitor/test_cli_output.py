"""What the ``qkwatch`` command prints, against a real ``qkwatch serve``: every table has a header row; an
alert still firing when its run ended reads "run ended while firing", with the run's last step and its last
values, in ``qkwatch alerts`` and ``qkwatch runs show``; and a reader that closes the pipe early
(``| head -1``) ends the command quietly, without a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.live import ROOT, LiveCollector
from tests.monitor.conftest import report

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # every print is a write: a closed pipe shows at the first line


def qkwatch(*args: str, status: int = 0, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        input=stdin,
    )
    assert done.returncode == status, done.stderr[-3000:]
    return done


def columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A live collector with run cli/ended (finished while layers 1-3 collapse, so its alerts ended with it)
    and run cli/live (layer 0 firing)."""
    with LiveCollector(tmp_path_factory.mktemp("cli")) as live:
        c = live.client()
        ended = c.create_run("cli", "ended", {"n_layers": 4})
        rows = [[0.2, 0.9, 0.9, 0.9]] * 2 + [[0.2, 0.93, 0.91, 0.95]]
        c.send_reports(ended, [report(10 * i, {"qkai": row}) for i, row in enumerate(rows)])
        c.set_status(ended, "finished")
        running = c.create_run("cli", "live", {"n_layers": 4})
        c.send_reports(running, [report(10 * i, {"qkai": [0.9, 0.2, 0.2, 0.2]}) for i in range(3)])
        yield live, ended, running


def test_runs_list_has_a_header_row(served) -> None:
    live, ended, running = served
    header, *lines = qkwatch("runs", "list", "--url", live.url).stdout.splitlines()
    assert columns(header) == ["id", "run", "status", "attempt", "last step", "updated (UTC)", "tags"]
    got = {columns(line)[1]: columns(line) for line in lines}
    assert got["cli/ended"][:5] == [ended.id, "cli/ended", "finished", "1", "20"]
    assert got["cli/live"][:5] == [running.id, "cli/live", "running", "1", "20"]


def test_alerts_show_an_alert_of_an_ended_run_as_ended_while_firing_with_its_last_values(served) -> None:
    live, _, _ = served
    header, *lines = qkwatch("alerts", "--run", "cli/ended", "--url", live.url).stdout.splitlines()
    assert columns(header) == [
        "state",
        "severity",
        "run",
        "rule",
        "layers",
        "onset step",
        "end",
        "last values",
        "summary",
    ]
    rows = {columns(line)[3] + ":" + columns(line)[4]: columns(line) for line in lines}
    assert set(rows) == {"qkai_high:1", "qkai_high:2", "qkai_high:3", "collapse_band:1,2,3"}
    assert all(r[0] == "run ended while firing" and r[6] == "run finished at step 20" for r in rows.values())
    assert rows["qkai_high:1"][7] == "1: 0.93" and rows["collapse_band:1,2,3"][7] == "1: 0.93, 2: 0.91, 3: 0.95"
    assert "resolved" not in "\n".join(lines)
    only = qkwatch("alerts", "--state", "ended", "--url", live.url).stdout.splitlines()[1:]
    assert len(only) == 4 and all("cli/ended" in line for line in only)
    firing = qkwatch("alerts", "--state", "firing", "--url", live.url).stdout.splitlines()[1:]
    assert [columns(line)[:5] for line in firing] == [["firing", "warning", "cli/live", "qkai_high", "0"]]


def test_runs_show_lists_the_alerts_that_are_open_firing_or_ended_with_the_run(served) -> None:
    live, ended, _ = served
    shown = json.loads(qkwatch("runs", "show", "cli/ended", "--url", live.url).stdout)
    assert shown["run"]["id"] == ended.id and len(shown["alerts"]) == 4
    assert {(a["state"], a["run_end"], a["ended_step"]) for a in shown["alerts"]} == {("ended", "finished", 20)}
    assert sorted(a["last_values"] for a in shown["alerts"]) == [[0.91], [0.93], [0.93, 0.91, 0.95], [0.95]]
    live_run = json.loads(qkwatch("runs", "show", "cli/live", "--url", live.url).stdout)
    assert [a["state"] for a in live_run["alerts"]] == ["firing"]


def test_runs_are_tagged_untagged_annotated_and_listed_by_tag(served) -> None:
    """``runs tag``/``untag``/``note`` change a run through the API and say what it has then; ``runs list``
    shows the tags in its last column and ``--tag`` keeps the runs that have every tag given; ``runs show``
    carries tags and notes; a bad tag is one line naming the field, and changes nothing."""
    live, _, _ = served
    c = live.client()
    c.create_run("tags", "a", tags=["baseline"])
    c.create_run("tags", "b")
    url = ("--url", live.url)
    said = qkwatch("runs", "tag", "tags/b", "lr=3e-4", "baseline", "sweep/a", *url).stdout
    assert said == "tags/b: tags baseline,lr=3e-4,sweep/a\n"
    assert qkwatch("runs", "untag", "tags/b", "sweep/a", "never-had", *url).stdout == "tags/b: tags baseline,lr=3e-4\n"

    def listed(*tags: str) -> dict[str, str]:
        header, *lines = qkwatch("runs", "list", "--project", "tags", *url, *tags).stdout.splitlines()
        assert columns(header)[-1] == "tags"
        return {columns(line)[1]: columns(line)[-1] for line in lines}

    assert listed() == {"tags/a": "baseline", "tags/b": "baseline,lr=3e-4"}
    assert listed("--tag", "lr=3e-4") == {"tags/b": "baseline,lr=3e-4"}
    assert listed("--tag", "baseline", "--tag", "lr=3e-4") == {"tags/b": "baseline,lr=3e-4"}
    assert listed("--tag", "baseline", "--tag", "nobody") == {}
    qkwatch("runs", "untag", "tags/a", "baseline", *url)
    assert listed()["tags/a"] == "-"

    assert qkwatch("runs", "note", "tags/b", "diverged at 2k", *url).stdout == "tags/b: notes set (14 characters)\n"
    notes = "restarted with clipping\n\n* grad clip 1.0\n"
    assert qkwatch("runs", "note", "tags/b", "-", *url, stdin=notes).stdout == "tags/b: notes set (41 characters)\n"
    shown = json.loads(qkwatch("runs", "show", "tags/b", *url).stdout)["run"]
    assert (shown["tags"], shown["notes"]) == (["baseline", "lr=3e-4"], notes)

    bad = qkwatch("runs", "tag", "tags/b", "ok", "not,ok", *url, status=1)
    assert bad.stdout == "" and len(bad.stderr.splitlines()) == 1 and "add_tags.1" in bad.stderr
    assert "no space or comma" in bad.stderr
    assert c.run("tags/b").tags == ("baseline", "lr=3e-4")
    assert qkwatch("runs", "note", "tags/b", "", *url).stdout == "tags/b: notes cleared\n"
    assert c.run("tags/b").notes is None


def test_token_list_has_a_header_row(served) -> None:
    live, _, _ = served
    token = live.token("read", project="cli")
    header, *lines = qkwatch("token", "list", "--database-url", live.db_url).stdout.splitlines()
    assert columns(header) == ["id", "name", "project", "scopes", "state"]
    assert any(columns(line)[2:] == ["cli", "read", "active"] for line in lines) and token not in "".join(lines)


@pytest.mark.parametrize(
    "args",
    [
        ["runs", "list", "--url", "{url}"],
        ["runs", "show", "cli/ended", "--url", "{url}"],
        ["alerts", "--url", "{url}"],
        ["train", "--list"],
    ],
    ids=["runs-list", "runs-show", "alerts", "train-list"],
)
def test_a_closed_pipe_ends_the_command_quietly(served, args: list[str]) -> None:
    """The reader is gone before the first line (the extreme of ``| head -1``): status 1 and not a word on stderr."""
    live, _, _ = served
    argv = [sys.executable, "-m", "qkwatch.cli", *(a.format(url=live.url) for a in args)]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_head_gets_the_header_and_nothing_is_said_on_stderr(served) -> None:
    live, _, _ = served
    command = f"{sys.executable} -m qkwatch.cli runs list --url {live.url} | head -1"
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0 and done.stderr == ""
    assert columns(done.stdout) == ["id", "run", "status", "attempt", "last step", "updated (UTC)", "tags"]
