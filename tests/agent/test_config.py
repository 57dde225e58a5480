"""Settings resolve as argument, then environment, then default, then validate; each component's
settings land in its own config."""

from __future__ import annotations

import pytest

from qkwatch.agent.config import AgentConfig
from qkwatch.agent.lambdas.lambdas import LambdasConfig
from qkwatch.agent.probe.probe import ProbeConfig
from qkwatch.agent.shipping.disk_spool import SpoolConfig
from qkwatch.agent.shipping.shipper import SenderConfig


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
        ({}, {"QKWATCH_EVERY": "often"}, "QKWATCH_EVERY='often': every"),
        ({}, {"QKWATCH_EVERY": "0"}, "QKWATCH_EVERY=0: every must be a positive integer"),
        ({}, {"QKWATCH_RUN": "a b"}, "QKWATCH_RUN='a b': run must be"),
        ({"pr_rows": 1}, {}, "pr_rows must be an integer >= 2"),
        ({"spool_max_bytes": 0}, {}, "spool_max_bytes must be a positive integer"),
        ({"lambda_stale_seconds": float("nan")}, {}, "lambda_stale_seconds must be a positive number"),
        ({"url": "ftp://x"}, {}, "url must be an http"),
        ({"run": "has space"}, {}, "run must be"),
        ({"flush_seconds": -1}, {}, "flush_seconds must be a positive number"),
        (
            {"flush_seconds": 10**401},
            {},
            "flush_seconds must be a positive number of seconds, got an integer of 1333 bits",
        ),
        ({"colour": "red"}, {}, "unknown agent setting 'colour'"),
    ],
)
def test_bad_settings_name_the_setting(monkeypatch, kwargs, env, match) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        AgentConfig.resolve(**kwargs)


def test_each_setting_lands_in_the_config_of_its_owner(monkeypatch) -> None:
    monkeypatch.setenv("QKWATCH_SAMPLE_ROWS", "8")  # only the documented variables are read
    monkeypatch.setenv("qkwatch_every", "3")  # and with their exact names
    cfg = AgentConfig.resolve(sample_rows=None, heads=True, segment_bytes=1024, flush_seconds=0.1, lambda_sync_every=2)
    assert cfg.every == 50
    assert cfg.probe == ProbeConfig(heads=True)
    assert cfg.spooling == SpoolConfig(segment_bytes=1024)
    assert cfg.sender == SenderConfig(flush_seconds=0.1)
    assert cfg.lambdas == LambdasConfig(lambda_sync_every=2)
    assert set(AgentConfig.settings()) >= {"url", "every", "sample_rows", "spool_max_age_seconds", "backoff_cap"}
