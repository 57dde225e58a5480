"""History: series, heatmap, compare, export. Reads show the merged view of all attempts (per
point the latest attempt that logged it wins) unless ``attempt`` picks one."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse, StreamingResponse

from monitor.api.deps import Reader, StoreDep, load_run
from monitor.api.schemas import ComparePublic, HeatmapPublic, SeriesPublic
from monitor.store.models import LAYER_VALUE, RUN_SCALAR, Series
from monitor.store.store import NotFound
from monitor.wire import encode_value

router = APIRouter(prefix="/v1", tags=["queries"])

Metric = Annotated[str, Query(min_length=1, max_length=128)]
MAX_STEP = 2**62
MAX_INDEX = 1_000_000
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
Attempt = Annotated[int | None, Query(ge=1, le=MAX_INDEX, description="Only this attempt; default: the merged view")]


def _enc(values: list) -> list:
    return [encode_value(v) for v in values]


def _series_body(s: Series) -> dict:
    return {"steps": s.steps, "values": _enc(s.values), "min": _enc(s.mins), "max": _enc(s.maxs)}


@router.get("/runs/{run_id}/series", response_model=SeriesPublic)
def series(run_id: str, metric: Metric, store: StoreDep, principal: Reader,
           layer: Annotated[int, Query(ge=-1, le=MAX_INDEX, description="-1: a run-level scalar")] = RUN_SCALAR,
           head: Annotated[int, Query(ge=-1, le=MAX_INDEX, description="-1: the layer value")] = LAYER_VALUE,
           start: Step = None, end: Step = None, max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
           attempt: Attempt = None) -> JSONResponse:
    """One layer's values over steps; buckets (when over ``max_points``) keep min and max."""
    run = load_run(store, run_id, principal)
    s = store.series(run, metric, layer, head=head, start=start, end=end, max_points=max_points, attempt=attempt)
    return JSONResponse({"metric": metric, "layer": layer, "head": head, "attempt": attempt,
                         "downsampled": s.downsampled, **_series_body(s)})


@router.get("/runs/{run_id}/heatmap", response_model=HeatmapPublic)
def heatmap(run_id: str, metric: Metric, store: StoreDep, principal: Reader, start: Step = None, end: Step = None,
            max_steps: Annotated[int, Query(ge=1, le=20_000)] = 500,
            agg: Literal["max", "min", "mean"] = "max",
            head: Annotated[int, Query(ge=-1, le=MAX_INDEX)] = LAYER_VALUE, attempt: Attempt = None) -> JSONResponse:
    """All layers over steps; a bucket of steps takes the max by default, so a band is never averaged away."""
    run = load_run(store, run_id, principal)
    h = store.heatmap(run, metric, start=start, end=end, max_steps=max_steps, agg=agg, head=head, attempt=attempt)
    return JSONResponse({"metric": metric, "agg": agg, "attempt": attempt, "downsampled": h.downsampled,
                         "steps": h.steps, "layers": h.layers, "values": [_enc(row) for row in h.values]})


@router.get("/compare", response_model=ComparePublic)
def compare(run: Annotated[list[str], Query(min_length=1, max_length=50, description="run ids (repeat, or comma)")],
            metric: Metric, store: StoreDep, principal: Reader,
            layer: Annotated[int, Query(ge=-1, le=MAX_INDEX)] = RUN_SCALAR, start: Step = None, end: Step = None,
            max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> JSONResponse:
    """The same series of several runs in one call (merged views)."""
    ids = [i for item in run for i in item.split(",") if i]
    try:
        rows = store.compare_runs(ids)
    except NotFound as exc:
        raise HTTPException(404, str(exc)) from None
    out = []
    for r in rows:
        principal.check_project(r.project)
        s = store.series(r, metric, layer, start=start, end=end, max_points=max_points)
        out.append({"run": r.id, "name": r.name, "project": r.project, **_series_body(s)})
    return JSONResponse({"metric": metric, "layer": layer, "series": out})


COLUMNS = ("attempt", "step", "metric", "layer", "head", "value")


@router.get("/runs/{run_id}/export", response_class=StreamingResponse,
            responses={200: {"content": {"text/csv": {}, "application/x-ndjson": {}}}})
def export(run_id: str, store: StoreDep, principal: Reader, format: Literal["csv", "jsonl"] = "csv",
           attempt: Attempt = None) -> StreamingResponse:
    """Every point of the run, streamed: CSV with a header, or one JSON object per line.

    Columns: attempt, step, metric, layer (-1: run scalar), head (-1: layer value), value
    (a number, or nan/inf/-inf). Ordered by metric, head, layer, step.
    """
    run = load_run(store, run_id, principal)
    rows = store.export_rows(run, attempt=attempt)
    body = _csv(rows) if format == "csv" else _jsonl(rows)
    media = "text/csv" if format == "csv" else "application/x-ndjson"
    filename = f"{run.name}.{format}".replace('"', "")
    disposition = f'attachment; filename="{filename}"'
    return StreamingResponse(body, media_type=media, headers={"Content-Disposition": disposition})


def _csv(rows: Iterator[tuple]) -> Iterator[str]:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for i, r in enumerate(rows, 1):
        writer.writerow((*r[:5], encode_value(r[5])))
        if i % 2000 == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def _jsonl(rows: Iterator[tuple]) -> Iterator[str]:
    chunk = []
    for r in rows:
        chunk.append(json.dumps(dict(zip(COLUMNS, (*r[:5], encode_value(r[5])), strict=True))))
        if len(chunk) >= 2000:
            yield "\n".join(chunk) + "\n"
            chunk = []
    if chunk:
        yield "\n".join(chunk) + "\n"
