"""The live page in a real headless Chromium against a real collector: the compare view draws one
heatmap per run in the URL, titled with the run, and the QKAI colour scale breaks at the served
collapse threshold.

Chromium is Debian's ``/usr/bin/chromium`` (installed by ``.ci/run``); without it the browser tests
skip locally and fail under CI=true.
"""

from __future__ import annotations

import math
import struct
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from monitor.client import Client
from monitor.main import create_app
from tests.conftest import missing_service
from tests.live import LiveCollector
from tests.monitor.conftest import make_settings

CHROMIUM = "/usr/bin/chromium"
N_LAYERS = 8
BAND = (3, 4, 5)
STEPS = range(0, 301, 5)


def qkai(step: int, layer: int, peak: float) -> float:
    """A smooth synthetic QKAI: layers of ``BAND`` rise towards ``peak`` around step 150, the rest stay low."""
    base = 0.25 + 0.025 * layer + 0.015 * math.sin(0.37 * step + layer)
    if layer not in BAND:
        return base
    top = peak - (0.08 if layer != 4 else 0.0)
    return base + (top - base) / (1 + math.exp(-(step - 150) / 20))


def seed(client: Client) -> tuple[dict, dict]:
    """Two runs of project ``demo``: ``vanilla`` grows a QKAI band above 0.70 at layers 3-5, ``raa`` does not."""
    runs = []
    for name, peak in (("vanilla", 0.86), ("raa", 0.66)):
        run = client.create_run("demo", name, {"n_layers": N_LAYERS})
        reports = [
            {
                "step": s,
                "time": float(s),
                "layers": {
                    "qkai": [qkai(s, i, peak) for i in range(N_LAYERS)],
                    "attn_entropy": [1 - 0.8 * qkai(s, i, peak) for i in range(N_LAYERS)],
                },
            }
            for s in STEPS
        ]
        client.send_reports(run["id"], reports)
        runs.append(run)
    return runs[0], runs[1]


def chromium(url: str, profile: Path, *extra: str, budget_ms: int = 8000, timeout: float = 120) -> str:
    """Open ``url`` in headless Chromium for ``budget_ms`` of virtual time; its stdout (the DOM with --dump-dom)."""
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *extra,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class Figures(HTMLParser):
    """The plotly figures of a dumped DOM, in page order: each ``div.map`` (and ``div#latest``) with its
    title, number of heatmap traces, colour-bar gradient stops and the raw texts of its labels."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self._depth = 0  # divs open inside the current figure; 0 outside one
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "div":
            if self._depth:
                self._depth += 1
            elif "map" in classes or a.get("id") == "latest":
                self._depth = 1
                self.figures.append(
                    {"run": a.get("data-run", a.get("id")), "title": "", "heatmaps": 0, "stops": [], "texts": []}
                )
            return
        if not self._depth:
            return
        figure = self.figures[-1]
        if tag == "g" and "hm" in classes:
            figure["heatmaps"] += 1
        elif tag == "stop":
            figure["stops"].append((a["offset"], a["stop-color"]))
        elif tag == "text":
            self._in_title = "gtitle" in classes
            figure["texts"].append(a.get("data-unformatted", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._depth:
            self._depth -= 1
        elif tag == "text":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.figures[-1]["title"] += data


def figures(dom: str) -> list[dict]:
    parser = Figures()
    parser.feed(dom)
    return parser.figures


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict, dict]]:
    """A real collector holding the two seeded runs: (url, vanilla, raa)."""
    if not Path(CHROMIUM).exists():
        missing_service(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    with LiveCollector(tmp_path_factory.mktemp("collector")) as live:
        vanilla, raa = seed(live.client())
        yield live.url, vanilla, raa


def test_compare_view_draws_one_heatmap_per_run_with_the_threshold_break(page, tmp_path: Path) -> None:
    url, vanilla, raa = page
    assert httpx.get(f"{url}/ui/config.json").json() == {"collapse_threshold": 0.70}

    shown = figures(chromium(f"{url}/?run={vanilla['id']}&run={raa['id']}", tmp_path / "profile", "--dump-dom"))

    maps, latest = shown[:-1], shown[-1]
    assert [m["run"] for m in maps] == [vanilla["id"], raa["id"]]  # the URL's order
    assert [m["heatmaps"] for m in maps] == [1, 1]
    assert "demo/vanilla (running)" in maps[0]["title"]
    assert "3 layers above 0.70: 3, 4, 5" in maps[0]["title"]
    assert "demo/raa (running)" in maps[1]["title"]
    assert "no layer above 0.70" in maps[1]["title"]
    for m in maps:
        # A sharp break: two colour-bar stops at the threshold, dark blue below and light yellow above.
        at = [color for offset, color in m["stops"] if offset == "70%"]
        assert at == ["rgb(8, 48, 107)", "rgb(254, 217, 118)"], m["stops"]
        assert "<b>0.70 collapse</b>" in m["texts"]
    assert latest["run"] == "latest" and "latest qkai per layer" in latest["title"]
    assert {"demo/vanilla", "demo/raa", "collapse 0.70"} <= set(latest["texts"])


def test_without_runs_in_the_url_the_running_runs_are_compared(page, tmp_path: Path) -> None:
    url, vanilla, raa = page
    shown = figures(chromium(f"{url}/?metric=attn_entropy", tmp_path / "profile", "--dump-dom"))
    maps = shown[:-1]
    assert {m["run"] for m in maps} == {vanilla["id"], raa["id"]}
    assert all(m["heatmaps"] == 1 and "no layer above" not in m["title"] for m in maps)
    assert all(not any("collapse" in t for t in m["texts"]) for m in maps)  # no threshold outside QKAI


def test_screenshot_of_the_compare_view(page, tmp_path: Path) -> None:
    url, vanilla, raa = page
    shot = tmp_path / "compare.png"
    chromium(
        f"{url}/?run={vanilla['id']}&run={raa['id']}",
        tmp_path / "profile",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        "--window-size=1400,900",
    )
    assert png_size(shot) == (1400, 900)
    assert shot.stat().st_size > 20_000  # drawn, not blank


def test_config_is_served_without_a_token_and_follows_the_settings(sqlite_url: str) -> None:
    with TestClient(create_app(make_settings(sqlite_url, collapse_threshold=0.65))) as client:
        assert client.get("/v1/runs").status_code == 401
        r = client.get("/ui/config.json")
    assert r.status_code == 200
    assert r.json() == {"collapse_threshold": 0.65}
    assert r.headers["cache-control"] == "no-store"
