"""Tags and notes from the agent: settings (argument, then ``QKWATCH_TAGS``/``QKWATCH_NOTES``, then none),
what the run's spool records, and a run against a real collector that carries them, resumed and synced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkwatch import agent
from qkwatch.agent.config import AgentConfig
from qkwatch.agent.identity import RunIdentity
from tests.agent.test_delivery import FAST
from tests.agent.tiny import TinyGPT, train
from tests.live import ROOT, LiveCollector


def test_tags_and_notes_come_from_the_argument_then_the_environment(monkeypatch) -> None:
    assert (AgentConfig.resolve().tags, AgentConfig.resolve().notes) == ((), None)
    monkeypatch.setenv("QKWATCH_TAGS", " lr=3e-4, baseline,,baseline ")
    monkeypatch.setenv("QKWATCH_NOTES", "from the environment")
    cfg = AgentConfig.resolve()
    assert (cfg.tags, cfg.notes) == (("baseline", "lr=3e-4"), "from the environment")
    cfg = AgentConfig.resolve(tags=["sweep/a", "ablation"], notes="from the call")
    assert (cfg.tags, cfg.notes) == (("ablation", "sweep/a"), "from the call")
    assert AgentConfig.resolve(tags="a,b").tags == ("a", "b")  # one string: comma-separated, as the variable
    assert AgentConfig.resolve(tags=iter(["z", "y"])).tags == ("y", "z")
    assert AgentConfig.resolve(tags=[]).tags == ()  # given, empty: no tags, whatever the environment says


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({"tags": ["not ok"]}, {}, "tags: tag 'not ok' must be 1-64 characters"),
        ({"tags": ["x" * 65]}, {}, "tags: tag 'x"),
        ({"tags": [f"t{i}" for i in range(51)]}, {}, "tags: 51 tags; a run has at most 50"),
        ({"tags": [1]}, {}, "tags: a tag is a string, got 1"),
        ({}, {"QKWATCH_TAGS": "a b"}, "QKWATCH_TAGS='a b': tags: tag 'a b' must be"),
        ({"notes": "x" * 10241}, {}, "notes: notes are 10241 bytes as UTF-8; the limit is 10240"),
        ({"notes": "a\x00b"}, {}, "notes: notes may not hold the control character"),
        ({"notes": 3}, {}, "notes: notes must be a string"),
        ({}, {"QKWATCH_NOTES": "bell\x07"}, "QKWATCH_NOTES='bell\\\\x07': notes: "),
    ],
)
def test_bad_tags_and_notes_fail_attach_naming_the_setting(monkeypatch, kwargs, env, match) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        AgentConfig.resolve(**kwargs)


def test_the_spool_records_them_so_a_later_delivery_sends_them(tmp_path: Path) -> None:
    with agent.attach(
        TinyGPT(), url=None, project="tests", run="offline", spool=str(tmp_path), tags=["b", "a"], notes="n"
    ) as a:
        meta = json.loads((Path(a.spool_path) / "meta.json").read_text())
    assert (meta["tags"], meta["notes"]) == (["a", "b"], "n")
    body = RunIdentity.of_spool(meta, meta["attempt_key"]).create_body()
    assert (body["tags"], body["notes"]) == (["a", "b"], "n")
    old = {k: v for k, v in meta.items() if k not in ("tags", "notes")}  # a spool written before tags
    assert not {"tags", "notes"} & set(RunIdentity.of_spool(old, None).create_body())


def run_of(collector: LiveCollector, name: str) -> dict:
    with collector.client() as c:
        return c.run(f"tests/{name}").raw


@pytest.mark.slow
def test_an_agent_run_carries_its_tags_and_notes_and_a_resume_adds_tags_and_keeps_edited_notes(
    tmp_path: Path, collector: LiveCollector
) -> None:
    collector.start()
    model = TinyGPT()
    settings = {"url": collector.url, "project": "tests", "run": "tagged", "spool": str(tmp_path / "s"), "every": 1}
    with agent.attach(model, tags=["baseline", "lr=3e-4"], notes="first launch", **settings, **FAST) as a:
        train(a, model, 3)
    run = run_of(collector, "tagged")
    assert (run["tags"], run["notes"], run["last_step"]) == (["baseline", "lr=3e-4"], "first launch", 2)

    with collector.client() as c:  # someone annotates the run between the two launches
        c.update_run("tests/tagged", notes="diverged at step 2: resumed with clipping", add_tags=["diverged"])
    with agent.attach(model, tags="baseline,clipped", notes="first launch", **settings, **FAST) as a:
        train(a, model, 6, start=3)
    run = run_of(collector, "tagged")
    assert run["tags"] == ["baseline", "clipped", "diverged", "lr=3e-4"]  # added, nothing taken away
    assert run["notes"] == "diverged at step 2: resumed with clipping"  # the edit outlives the restart
    assert (run["latest_attempt"], run["last_step"], run["status"]) == (2, 5, "finished")


@pytest.mark.slow
def test_a_run_spooled_offline_gets_its_tags_and_notes_when_qkwatch_sync_delivers_it(
    tmp_path: Path, collector: LiveCollector
) -> None:
    model = TinyGPT()
    spool = tmp_path / "s"
    with agent.attach(
        model, url=None, project="tests", run="synced", spool=str(spool), every=1, tags=["offline"], notes="n"
    ) as a:
        train(a, model, 2)
    collector.start()
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "sync", str(spool), "--collector", collector.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    run = run_of(collector, "synced")
    assert (run["tags"], run["notes"], run["last_step"]) == (["offline"], "n", 1)
