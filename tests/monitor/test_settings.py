"""Every collector setting refuses a bad value when it is read, in one line naming the variable and the
value: numbers finite and in range, URLs http(s), nothing empty that needs a value (issue 21, L4)."""

from __future__ import annotations

import os

import pytest

from qkwatch.monitor.settings import MAX_COUNT, SECRETS, SettingError, Settings, check_http_url, load_settings
from qkwatch.rules.ruleset import RuleSet

BIG = "1" * 401
"""A 401-digit integer: too large for a float, and for any database column."""

BAD = [
    ("database_url", ""),
    ("database_url", "   "),
    ("open_access", "maybe"),
    ("metrics_public", "2"),
    ("auto_migrate", "sometimes"),
    ("max_body_bytes", "0"),
    ("max_body_bytes", BIG),
    ("max_body_bytes", "4MiB"),
    ("max_points_per_batch", "-1"),
    ("max_points_per_batch", str(MAX_COUNT + 1)),
    ("max_reports_per_batch", "0"),
    ("max_reports_per_batch", BIG),
    ("max_metric_names_per_run", "0"),
    ("max_metric_names_per_run", BIG),
    ("stale_timeout_s", "0"),
    ("stale_timeout_s", "nan"),
    ("stale_timeout_s", "inf"),
    ("stale_timeout_s", "1e999"),
    ("maintenance_interval_s", "inf"),
    ("maintenance_interval_s", "nan"),
    ("maintenance_interval_s", "86401"),
    ("retention_days", "nan"),
    ("retention_days", "inf"),
    ("retention_days", "1e300"),
    ("retention_days", "-1"),
    ("alert_rules_file", ""),
    ("webhook_urls", "ftp://x"),
    ("webhook_urls", "http://ok.example,ftp://x"),
    ("webhook_urls", "hook.example/path"),
    ("webhook_urls", "http://"),
    ("webhook_urls", "http://hook.example:70000/"),
    ("webhook_max_attempts", "0"),
    ("webhook_max_attempts", BIG),
    ("webhook_timeout_s", "inf"),
    ("webhook_timeout_s", "nan"),
    ("webhook_timeout_s", "0"),
    ("webhook_timeout_s", "3601"),
    ("webhook_allow_private", "maybe"),
    ("webhook_secret", "s3cr3t-t00-sh0rt"[:12]),
    ("webhook_max_response_bytes", "-1"),
    ("webhook_max_response_bytes", BIG),
    ("rate_limit_per_s", "inf"),
    ("rate_limit_per_s", "nan"),
    ("rate_limit_per_s", "1e300"),
    ("rate_limit_per_s", "fast"),
    ("rate_limit_burst", "0"),
    ("rate_limit_burst", "10000000000000000000000"),
    ("metrics_max_runs", "-1"),
    ("metrics_max_runs", BIG),
    ("metrics_max_layers", "0"),
    ("metrics_max_layers", BIG),
    ("metrics_max_ranks", "0"),
    ("metrics_max_ranks", BIG),
    ("metrics_max_series_per_run", "-1"),
    ("metrics_max_series_per_run", "nan"),
    ("collapse_threshold", "nan"),
    ("collapse_threshold", "inf"),
    ("collapse_threshold", "1e400"),
    ("collapse_threshold", "1"),
    ("collapse_threshold", "0"),
    ("h_star", "nan"),
    ("h_star", "-inf"),
    ("h_star", "1.5"),
    ("sqlite_busy_timeout_ms", "-1"),
    ("sqlite_busy_timeout_ms", BIG),
    ("background", "perhaps"),
    ("external_url", "ftp://x"),
    ("external_url", "collector.example"),
    ("external_url", "http://collector.example:0"),
]


@pytest.fixture(autouse=True)
def no_qkwatch_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the variables it sets."""
    for name in list(os.environ):
        if name.startswith("QKWATCH_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_bad_value_of_any_setting_is_refused_in_one_line_naming_the_variable_and_the_value(
    monkeypatch: pytest.MonkeyPatch, field: str, value: str
):
    variable = f"QKWATCH_{field.upper()}"
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingError) as refused:
        load_settings()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{variable}=")
    if field in SECRETS:  # a secret is named, never shown
        assert value not in message and message.startswith(f"{variable}='***': "), message
        return
    shown = value if len(value) < 60 else value[:40]  # a long value is cut, never left out
    assert shown.split(",")[-1] in message, message


def test_every_setting_has_a_bad_value_above():
    assert {field for field, _ in BAD} == set(Settings.model_fields)


def test_a_flag_is_named_instead_of_the_variable():
    with pytest.raises(SettingError, match=r"^--database-url='': is empty"):
        load_settings({"database_url": "--database-url"}, database_url="")


def test_good_values_at_the_limits_are_kept(monkeypatch: pytest.MonkeyPatch):
    for variable, value in {
        "QKWATCH_WEBHOOK_URLS": " http://a.example/hook , https://b.example:9443/x ",
        "QKWATCH_EXTERNAL_URL": "https://qkwatch.example.org",
        "QKWATCH_RETENTION_DAYS": "36500",
        "QKWATCH_MAINTENANCE_INTERVAL_S": "86400",
        "QKWATCH_WEBHOOK_TIMEOUT_S": "3600",
        "QKWATCH_STALE_TIMEOUT_S": "1e9",
        "QKWATCH_MAX_POINTS_PER_BATCH": str(MAX_COUNT),
        "QKWATCH_METRICS_MAX_RUNS": "0",
        "QKWATCH_SQLITE_BUSY_TIMEOUT_MS": "0",
        "QKWATCH_COLLAPSE_THRESHOLD": "0.65",
    }.items():
        monkeypatch.setenv(variable, value)
    s = load_settings()
    assert s.webhook_urls == ["http://a.example/hook", "https://b.example:9443/x"]
    assert (s.retention_days, s.maintenance_interval_s, s.webhook_timeout_s) == (36500, 86400, 3600)
    assert (s.max_points_per_batch, s.metrics_max_runs, s.collapse_threshold) == (MAX_COUNT, 0, 0.65)


@pytest.mark.parametrize(
    "url", ["ftp://x", "hook.example", "http://", "http://:80/x", "http://a.example:0", "http://a b", "http://[::1"]
)
def test_the_rules_file_and_the_setting_refuse_the_same_webhook_urls(url: str):
    with pytest.raises(ValueError, match=r"webhooks\[1\]"):
        RuleSet.from_mapping({"rules": [], "webhooks": ["http://ok.example", url]})
    with pytest.raises(SettingError, match="QKWATCH_WEBHOOK_URLS"):
        load_settings(webhook_urls=[url])
    with pytest.raises(ValueError):
        check_http_url(url)
