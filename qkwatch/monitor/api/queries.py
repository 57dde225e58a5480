"""History: series, heatmap, whole-run history, compare, export. Reads show the merged view of all
attempts (per point the latest attempt that logged it wins) unless ``attempt`` picks one.

A query that cannot be answered says so rather than answering empty: a metric the run never
reported (404), a per-layer metric asked without a layer (422), a layer or head it does not have
(404), an attempt it does not have (404). A step range with nothing in it is a good question
with an empty answer (200).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import math
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal, TypeAlias

import numpy as np
import orjson
from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse, Response, StreamingResponse

from qkwatch.contract import api
from qkwatch.contract.responses import ComparePublic, HeatmapPublic, HistoryPublic, SeriesPublic
from qkwatch.contract.values import encode_value
from qkwatch.monitor.api.deps import Reader, StoreDep, load_run
from qkwatch.monitor.api.disposition import attachment
from qkwatch.monitor.api.run_ref import RunRef, RunRefRoute
from qkwatch.monitor.api.runs import check_attempt
from qkwatch.monitor.store.models import LAYER_VALUE, RUN_SCALAR, ExportRow, RunRow, Series
from qkwatch.monitor.store.store import Invalid, Store

router = APIRouter(tags=["queries"], route_class=RunRefRoute)

Metric = Annotated[str, Query(min_length=1, max_length=128)]
MAX_STEP = 2**62
MAX_INDEX = 1_000_000
MAX_HISTORY_VALUES = 2_000_000
"""The most values one history answer holds (about 20 MB of JSON); ask for a step range beyond it."""
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP)]
Attempt = Annotated[int | None, Query(ge=1, le=MAX_INDEX, description="Only this attempt; default: the merged view")]
JsonRows: TypeAlias = np.ndarray[Any, np.dtype[np.float64]] | list[Sequence[float | str | None]]
"""``GET /history``'s ``values`` of one metric before orjson writes them (see :func:`_json_rows`)."""


def _enc(values: Sequence[float | None]) -> list[float | str | None]:
    return [encode_value(v) for v in values]


def _enc_row(row: Sequence[float | None]) -> Sequence[float | str | None]:
    """A row of values as wire values; a row of finite numbers (the usual one) is returned as it is."""
    try:
        if all(map(math.isfinite, row)):  # type: ignore[arg-type]  # a None raises TypeError, caught below
            return row
    except TypeError:  # a None (not measured) in the row
        pass
    return [encode_value(v) for v in row]


def _json_rows(values: bytes, measured: bytes | None, width: int) -> JsonRows:
    """Native doubles and their measured bytes (see :func:`_f64`) -> ``values`` rows of wire values.

    The same rows as the grid's (``Store.history``), read from the bytes that ``encoding=f64`` sends.
    When every value is measured and finite (the usual run) the rows are a steps x layers numpy view
    of the bytes, which :func:`_dumps` writes without a Python float per value; otherwise lists,
    None where not measured and ``"nan"``, ``"inf"``, ``"-inf"`` spelled out.
    """
    if not width:
        return []
    grid = np.frombuffer(values, dtype=np.float64).reshape(-1, width)
    if measured is None and bool(np.isfinite(grid).all()):
        return grid
    flat: list[float | None] = grid.ravel().tolist()
    if measured is not None:
        flat = [v if m else None for v, m in zip(flat, measured, strict=True)]
    return [_enc_row(flat[i : i + width]) for i in range(0, len(flat), width)]


def _dumps(content: Any) -> bytes:
    """``content`` as JSON by orjson, numpy arrays (:func:`_json_rows`) included.

    orjson, not json.dumps, writes the doubles: number formatting was most of the answer's time
    (bench/RESULTS.md). Every value went through :func:`_json_rows` or :func:`_f64`, so no NaN or
    infinity is left for it to write as null.
    """
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def _f64(values: bytes, measured: bytes | None) -> dict[str, str | None]:
    """Native doubles and their measured bytes -> ``values_f64`` and ``measured`` (see :func:`history`)."""
    if sys.byteorder == "big":
        swapped = array("d")
        swapped.frombytes(values)
        swapped.byteswap()
        values = swapped.tobytes()
    return {
        "values_f64": base64.b64encode(values).decode("ascii"),
        "measured": base64.b64encode(measured).decode("ascii") if measured is not None else None,
    }


def _series_body(s: Series) -> dict[str, Any]:
    return {"steps": s.steps, "values": _enc(s.values), "min": _enc(s.mins), "max": _enc(s.maxs)}


def _label(run: RunRow) -> str:
    return f"{run.project}/{run.name}"


def _span(layers: list[int]) -> str:
    """What ``layers`` (sorted; -1: the run-level scalar) are, in words: "layers 0-3", "layers 1, 5"."""
    real = [la for la in layers if la >= 0]
    if not real:
        return "a run-level scalar"
    contiguous = real == list(range(real[0], real[-1] + 1))
    if len(real) == 1:
        text = f"layer {real[0]}"
    else:
        text = f"layers {real[0]}-{real[-1]}" if contiguous else f"layers {', '.join(map(str, real))}"
    return text + (" and a run-level scalar" if RUN_SCALAR in layers else "")


def _metric_layers(store: Store, run: RunRow, metric: str, head: int) -> list[int] | None:
    """The layers (-1: the run-level scalar) the run reported ``metric`` on; 404 when it never did.

    None for a metric the run reported only per head (no layer values to check against).
    """
    have = store.run_metrics(run)
    if metric in have:
        return have[metric]
    if head != LAYER_VALUE and store.has_points(run, metric, head):
        return None
    known = sorted(have)
    listed = ", ".join(known[:30]) + (", ..." if len(known) > 30 else "")
    raise HTTPException(
        404,
        f"run {_label(run)} has no metric {metric!r}"
        + (f"; it has {listed}" if known else "; it has reported none yet"),
    )


def _check_head(store: Store, run: RunRow, metric: str, head: int) -> None:
    if head != LAYER_VALUE and not store.has_points(run, metric, head):
        raise HTTPException(404, f"run {_label(run)} has no head {head} of metric {metric!r}")


def check_series(store: Store, run: RunRow, metric: str, layer: int, head: int = LAYER_VALUE) -> None:
    """4xx naming the problem unless the run has ``metric`` at ``layer`` (and ``head``)."""
    layers = _metric_layers(store, run, metric, head)
    if layers is not None and layer not in layers:
        if layer == RUN_SCALAR:
            raise HTTPException(422, f"metric {metric!r} has a value per layer ({_span(layers)}): pass layer=N")
        if layers == [RUN_SCALAR]:
            raise HTTPException(422, f"metric {metric!r} is a run-level scalar: leave out layer (or pass layer=-1)")
        raise HTTPException(
            404, f"run {_label(run)} has no layer {layer} of metric {metric!r} (it has {_span(layers)})"
        )
    _check_head(store, run, metric, head)


@router.get(
    api.SERIES,
    response_model=SeriesPublic,
    responses={
        404: {"description": "the run has no such metric, layer, head or attempt"},
        422: {"description": "a per-layer metric asked without a layer, or a scalar with one"},
    },
)
def series(
    run_id: RunRef,
    metric: Metric,
    store: StoreDep,
    principal: Reader,
    layer: Annotated[
        int, Query(ge=-1, le=MAX_INDEX, description="The layer; -1 (default): a run-level scalar")
    ] = RUN_SCALAR,
    head: Annotated[int, Query(ge=-1, le=MAX_INDEX, description="-1: the layer value")] = LAYER_VALUE,
    start: Step = None,
    end: Step = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    attempt: Attempt = None,
) -> JSONResponse:
    """One layer's values over steps; buckets (when over ``max_points``) keep min and max."""
    run = load_run(store, run_id, principal)
    check_attempt(run, attempt)
    check_series(store, run, metric, layer, head)
    s = store.series(run, metric, layer, head=head, start=start, end=end, max_points=max_points, attempt=attempt)
    return JSONResponse(
        {
            "metric": metric,
            "layer": layer,
            "head": head,
            "attempt": attempt,
            "downsampled": s.downsampled,
            **_series_body(s),
        }
    )


@router.get(
    api.HEATMAP,
    response_model=HeatmapPublic,
    responses={
        404: {"description": "the run has no such metric, head or attempt"},
        422: {"description": "a run-level scalar has no heatmap"},
    },
)
def heatmap(
    run_id: RunRef,
    metric: Metric,
    store: StoreDep,
    principal: Reader,
    start: Step = None,
    end: Step = None,
    max_steps: Annotated[int, Query(ge=1, le=20_000)] = 500,
    agg: Literal["max", "min", "mean"] = "max",
    head: Annotated[int, Query(ge=-1, le=MAX_INDEX)] = LAYER_VALUE,
    attempt: Attempt = None,
) -> JSONResponse:
    """All layers over steps; a bucket of steps takes the max by default, so a band is never averaged away."""
    run = load_run(store, run_id, principal)
    check_attempt(run, attempt)
    layers = _metric_layers(store, run, metric, head)
    if layers == [RUN_SCALAR]:
        raise HTTPException(
            422, f"metric {metric!r} is a run-level scalar, not a value per layer: read it with /series"
        )
    _check_head(store, run, metric, head)
    h = store.heatmap(run, metric, start=start, end=end, max_steps=max_steps, agg=agg, head=head, attempt=attempt)
    return JSONResponse(
        {
            "metric": metric,
            "agg": agg,
            "attempt": attempt,
            "downsampled": h.downsampled,
            "steps": h.steps,
            "layers": h.layers,
            "values": [_enc(row) for row in h.values],
        }
    )


@router.get(
    api.HISTORY,
    response_model=HistoryPublic,
    responses={
        404: {"description": "the run has no such metric or attempt"},
        422: {"description": "more than MAX_HISTORY_VALUES values: ask for a step range"},
    },
)
def history(
    run_id: RunRef,
    store: StoreDep,
    principal: Reader,
    metrics: Annotated[
        list[str] | None,
        Query(max_length=200, description="Metric names (repeat, or comma-separated); default: all of the run's"),
    ] = None,
    start: Step = None,
    end: Step = None,
    attempt: Attempt = None,
    encoding: Annotated[
        Literal["json", "f64"],
        Query(description="json: `values` as JSON rows; f64: `values_f64` and `measured`, base64 (see below)"),
    ] = "json",
) -> Response:
    """Every value of the run's metrics in one call, unbucketed, per metric a grid: ``steps``, ``layers``
    (-1: a run-level scalar) and ``values`` (one row per step, one value per layer; null: not measured).

    Layer values and run-level scalars; per-head values are read with /series or /export.
    ``encoding=f64`` sends the grid as ``values_f64``: base64 of the ``steps x layers`` values as
    little-endian IEEE 754 doubles, step-major (NaN and infinities as such), and ``measured``: base64
    of one byte per value (1: measured, 0: not; a 0's value is NaN), or null when all were measured.
    It skips formatting and parsing each number as text: the fastest way to read a whole run.
    """
    with store.snapshot() as snap:  # the run, its metrics and their values: one transaction
        run = load_run(snap, run_id, principal)
        check_attempt(run, attempt)
        have = snap.run_metrics(run)
        names = list(dict.fromkeys(n for item in metrics for n in item.split(",") if n)) if metrics else sorted(have)
        missing = [n for n in names if n not in have]
        if missing:
            raise HTTPException(
                404,
                f"run {_label(run)} has no metric {', '.join(map(repr, missing))}"
                + (f"; it has {', '.join(sorted(have))}" if have else "; it has reported none yet"),
            )
        try:
            doubles = snap.history_doubles(
                run, names, start=start, end=end, attempt=attempt, max_points=MAX_HISTORY_VALUES
            )
        except Invalid as exc:
            raise HTTPException(422, str(exc)) from None
    body: dict[str, dict[str, Any]]
    if encoding == "f64":
        body = {
            name: {"steps": steps, "layers": layers, **_f64(values, measured)}
            for name, (steps, layers, values, measured) in doubles.items()
        }
    else:
        body = {
            name: {"steps": steps, "layers": layers, "values": _json_rows(values, measured, len(layers))}
            for name, (steps, layers, values, measured) in doubles.items()
        }
    content = {"run": run.id, "project": run.project, "name": run.name, "attempt": attempt, "metrics": body}
    return Response(_dumps(content), media_type="application/json")


@router.get(api.COMPARE, response_model=ComparePublic)
def compare(
    run: Annotated[
        list[str], Query(min_length=1, max_length=50, description="run ids or project/name (repeat, or comma)")
    ],
    metric: Metric,
    store: StoreDep,
    principal: Reader,
    layer: Annotated[int, Query(ge=-1, le=MAX_INDEX)] = RUN_SCALAR,
    start: Step = None,
    end: Step = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> JSONResponse:
    """The same series of several runs in one call (merged views); each run must have it."""
    refs = [i for item in run for i in item.split(",") if i]
    rows = [load_run(store, ref, principal) for ref in refs]
    for r in rows:
        check_series(store, r, metric, layer)
    out = []
    for r in rows:
        s = store.series(r, metric, layer, start=start, end=end, max_points=max_points)
        out.append({"run": r.id, "name": r.name, "project": r.project, **_series_body(s)})
    return JSONResponse({"metric": metric, "layer": layer, "series": out})


COLUMNS = ("attempt", "step", "metric", "layer", "head", "value")


@router.get(
    api.EXPORT,
    response_class=StreamingResponse,
    responses={200: {"content": {"text/csv": {}, "application/x-ndjson": {}}}},
)
def export(
    run_id: RunRef, store: StoreDep, principal: Reader, format: Literal["csv", "jsonl"] = "csv", attempt: Attempt = None
) -> StreamingResponse:
    """Every point of the run, streamed: CSV with a header, or one JSON object per line.

    Columns: attempt, step, metric, layer (-1: run scalar), head (-1: layer value), value
    (a number, or nan/inf/-inf). Ordered by metric, head, layer, step.
    """
    run = load_run(store, run_id, principal)
    check_attempt(run, attempt)
    rows = store.export_rows(run, attempt=attempt)
    body = _csv(rows) if format == "csv" else _jsonl(rows)
    media = "text/csv" if format == "csv" else "application/x-ndjson"
    disposition = attachment(f"{run.name}.{format}")
    return StreamingResponse(body, media_type=media, headers={"Content-Disposition": disposition})


def _csv(rows: Iterator[ExportRow]) -> Iterator[str]:
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


def _jsonl(rows: Iterator[ExportRow]) -> Iterator[str]:
    chunk = []
    for r in rows:
        chunk.append(json.dumps(dict(zip(COLUMNS, (*r[:5], encode_value(r[5])), strict=True))))
        if len(chunk) >= 2000:
            yield "\n".join(chunk) + "\n"
            chunk = []
    if chunk:
        yield "\n".join(chunk) + "\n"
