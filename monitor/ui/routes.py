"""The live page: ``GET /`` (a plotly heatmap of a metric per layer over steps, refreshing).

Self-contained: plotly.js is served from the plotly package at ``/ui/plotly.min.js``, so the page
works without internet access. The page itself needs no token; its data calls do.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

router = APIRouter(include_in_schema=False)


@functools.cache
def _page() -> str:
    return resources.files("monitor.ui").joinpath("page.html").read_text()


@functools.cache
def _plotly() -> tuple[bytes, str]:
    from plotly.offline import get_plotlyjs  # heavy; only when the page is first opened

    body = get_plotlyjs().encode()
    return body, hashlib.sha256(body).hexdigest()[:16]


@router.get("/", response_class=HTMLResponse)
def page() -> HTMLResponse:
    return HTMLResponse(_page())


@router.get("/ui/plotly.min.js")
def plotly_js(request: Request) -> Response:
    body, etag = _plotly()
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304)
    return Response(body, media_type="application/javascript",
                    headers={"ETag": etag, "Cache-Control": "public, max-age=86400"})
