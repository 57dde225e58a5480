"""``qkwatch demo`` end to end: a collector, a training run with the agent, the live page's link."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.live import ROOT

pytestmark = pytest.mark.slow


def test_demo_trains_reports_and_prints_the_live_page(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "demo", "--recipe", "debug_cpu", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    link = re.search(r"live page:\s+(http://127\.0\.0\.1:\d+)/\?run=(\w+)", done.stdout)
    assert link, done.stdout
    assert "qkai" in done.stdout and "4 layers" in done.stdout  # the trained model's table
    with pytest.raises(httpx.ConnectError):  # the collector stopped with the demo
        httpx.get(f"{link.group(1)}/healthz", timeout=2)
    assert (tmp_path / "collector.db").exists()
