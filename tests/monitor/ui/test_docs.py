"""``/docs`` (Swagger UI) and ``/redoc`` work with no network: their JS and CSS come from the collector.

The HTML is checked with ``TestClient`` (every reference stays on the collector and answers 200); the
rendering in a headless Chromium whose host names all resolve to nothing but the loopback address, so a
page that still needed a CDN would stay blank.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from qkwatch.monitor.main import create_app
from tests.live import LiveCollector
from tests.monitor.conftest import make_settings
from tests.monitor.ui.browser import chromium, keep, need_chromium, off_site, png_size, references

# Each API path as Swagger UI renders it, one operation block per method.
API_PATHS = (
    "/v1/runs",
    "/v1/runs/{run_id}",
    "/v1/runs/{run_id}/reports",
    "/v1/runs/{run_id}/heatmap",
    "/v1/runs/{run_id}/series",
    "/v1/alerts",
    "/v1/runs/{run_id}/lambdas",
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    need_chromium()
    with LiveCollector(tmp_path_factory.mktemp("collector")) as collector:
        yield collector.url


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_reference_only_the_collectors_own_assets(sqlite_url: str, page: str) -> None:
    with TestClient(create_app(make_settings(sqlite_url))) as client:
        r = client.get(page)
        assert r.status_code == 200
        urls = references(r.text)
        assert off_site(urls) == []
        scripts = [u for u in urls if u.endswith(".js")]
        assert scripts, urls
        for url in urls:
            asset = client.get(url)
            assert asset.status_code == 200, url
            assert len(asset.content) > 1000, url  # the real bundle, not a stub
        assert client.get("/openapi.json").status_code == 200  # what the page reads, with no token


def test_swagger_ui_renders_the_operations_offline(live: str, tmp_path: Path) -> None:
    dom = chromium(f"{live}/docs", tmp_path / "profile", "--dump-dom", budget_ms=10_000)
    for path in API_PATHS:
        assert f'data-path="{path}"' in dom, path
    assert dom.count('class="opblock opblock-') >= 15  # one block per operation
    assert "qkwatch collector" in dom


def test_redoc_renders_the_operations_offline(live: str, tmp_path: Path) -> None:
    dom = chromium(f"{live}/redoc", tmp_path / "profile", "--dump-dom", budget_ms=10_000)
    for tag, operation in (
        ("runs", "list_runs_v1_runs_get"),
        ("queries", "heatmap_v1_runs__run_id__heatmap_get"),
        ("alerts", "list_alerts_v1_alerts_get"),
    ):
        assert f'id="tag/{tag}/operation/{operation}"' in dom, operation


def test_screenshot_of_the_docs(live: str, tmp_path: Path) -> None:
    shot = tmp_path / "docs.png"
    chromium(
        f"{live}/docs",
        tmp_path / "profile",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        "--window-size=1200,900",
        budget_ms=10_000,
    )
    keep(shot)
    assert png_size(shot) == (1200, 900)
    assert shot.stat().st_size > 30_000  # drawn, not a blank page
