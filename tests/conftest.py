"""Shared fixtures: real services, never mocks, and the CI rule for missing ones.

Locally a test whose service (PostgreSQL, Prometheus, Chromium) is missing skips with the
reason; under ``CI=true`` it fails instead, so CI can never pass by skipping.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_service(reason: str) -> None:
    """Skip (locally) or fail (under CI=true) because a real service the test needs is absent."""
    if IN_CI:
        pytest.fail(f"CI=true and a required service is missing: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def collector(tmp_path):
    """A real collector (``qkwatch serve --open``, SQLite) on a loopback port, not yet started."""
    from tests.live import LiveCollector

    live = LiveCollector(tmp_path)
    try:
        yield live
    finally:
        live.stop()
