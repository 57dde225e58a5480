"""The live page: ``GET /`` (plotly heatmaps of a metric per layer over steps, one per chosen run, refreshing).

Self-contained: plotly.js is served from the plotly package at ``/ui/plotly.min.js``, so the page
works without internet access. The page and ``/ui/config.json`` (settings the page draws with,
not run data) need no token; its data calls do.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from qkwatch.contract import api, colour_scale
from qkwatch.contract import metrics as catalogue
from qkwatch.monitor.api.deps import SettingsDep

router = APIRouter(include_in_schema=False)


@functools.cache
def _page() -> str:
    return resources.files("qkwatch.monitor.ui").joinpath("page.html").read_text()


@functools.cache
def _plotly() -> tuple[bytes, str]:
    from plotly.offline import get_plotlyjs  # heavy; only when the page is first opened

    body = get_plotlyjs().encode()
    return body, hashlib.sha256(body).hexdigest()[:16]


@router.get("/", response_class=HTMLResponse)
def page() -> HTMLResponse:
    return HTMLResponse(_page())


@router.get("/ui/config.json")
def config(settings: SettingsDep) -> JSONResponse:
    """What the page draws with: the collapse threshold, where its (and ``qkwatch report``'s) QKAI colour
    scale breaks from calm to alarming, that scale's colours, the target entropy H*, and the metric
    catalogue (which metrics it offers, in which order, on which scale) and how an alert's state reads."""
    body = {
        "collapse_threshold": settings.collapse_threshold,
        "h_star": settings.h_star,
        "colour_scale": colour_scale.as_json(),
        "metrics": catalogue.as_json(),
        "alert_state_text": api.ALERT_STATE_TEXT,
    }
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


@router.get("/ui/plotly.min.js")
def plotly_js(request: Request) -> Response:
    body, etag = _plotly()
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304)
    return Response(
        body, media_type="application/javascript", headers={"ETag": etag, "Cache-Control": "public, max-age=86400"}
    )
