"""Settings resolve as argument, then environment, then default, then validate."""

from __future__ import annotations

import pytest

from agent.config import AgentConfig


def test_argument_beats_environment_beats_default(monkeypatch) -> None:
    monkeypatch.setenv("QKWATCH_URL", "http://env:1")
    monkeypatch.setenv("QKWATCH_EVERY", "7")
    monkeypatch.setenv("QKWATCH_PROJECT", "from-env")
    cfg = AgentConfig.resolve(url="http://arg:2", project=None)
    assert (cfg.url, cfg.every, cfg.project) == ("http://arg:2", 7, "from-env")
    assert cfg.weight_every == 7 and cfg.spectra_every == 70  # derived defaults follow
    monkeypatch.delenv("QKWATCH_EVERY")
    assert AgentConfig.resolve().every == 50


@pytest.mark.parametrize(
    ("kwargs", "env", "match"),
    [
        ({"every": 0}, {}, "every must be a positive integer"),
        ({}, {"QKWATCH_EVERY": "often"}, "QKWATCH_EVERY='often'"),
        ({"url": "ftp://x"}, {}, "url must be an http"),
        ({"run": "has space"}, {}, "run must be"),
        ({"flush_seconds": -1}, {}, "flush_seconds must be a positive number"),
        ({"colour": "red"}, {}, "unknown agent setting 'colour'"),
    ],
)
def test_bad_settings_name_the_setting(monkeypatch, kwargs, env, match) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        AgentConfig.resolve(**kwargs)
