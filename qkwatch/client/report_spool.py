"""The data of ``qkwatch report --spool DIR``: one run read from its spool on disk, no collector.

The same :class:`RunData` the collector-backed report draws, built from the run's reports
(``qkwatch.contract.offline_reports.read_reports``) in the shapes the collector's API answers: the
band heatmaps (``GET .../heatmap``), the loss series, each layer's last QKAI, and the lambdas as
last applied (the ``lambda`` metric). What only a collector has is left empty: alerts (its rules
run at ingest), the lambda override audit trail, the running entropies.
"""

from __future__ import annotations

import math
from pathlib import Path

from qkwatch.client.report_data import MAX_POINTS, MAX_STEPS
from qkwatch.client.report_figures import Json, RunData, finite
from qkwatch.contract import metrics as catalogue
from qkwatch.contract.offline_reports import SpoolReports
from qkwatch.contract.values import decode_value


def spool_run_data(spool: SpoolReports) -> RunData:
    """``spool``'s run as the report draws it."""
    heatmaps = {m: heatmap(spool, m) for m in catalogue.primary_layer_metrics()}
    reports = spool.reports
    return RunData(
        run={
            "id": f"spool:{spool.path}",
            "project": spool.project,
            "name": spool.run,
            "status": spool.status or "unknown",
            "status_reason": spool.status_reason
            or (None if spool.status else "no end status in the spool (still running, or killed)"),
            "tags": spool.tags,
            "notes": spool.notes,
            "latest_attempt": "-",
            "last_step": reports[-1].step if reports else "-",
            "created_at": reports[0].time if reports else None,
            "last_report_at": reports[-1].time if reports else None,
            "config": spool.config,
        },
        heatmaps=heatmaps,
        latest=latest_values(spool, "qkai"),
        loss=series(spool, "loss"),
        val_loss=series(spool, "val_loss"),
        alerts=[],
        lambdas=applied_lambdas(spool),
        audit=[],
    )


def heatmap(spool: SpoolReports, metric: str) -> Json:
    """``metric`` per step and layer, as ``GET /v1/runs/{id}/heatmap`` answers; more than
    ``MAX_STEPS`` steps are bucketed by max, as the collector does."""
    rows = [(r.step, r.layers[metric]) for r in spool.reports if metric in r.layers]
    n_layers = max((len(values) for _, values in rows), default=0)
    steps = [step for step, _ in rows]
    values = [[finite(v) for v in values] + [None] * (n_layers - len(values)) for _, values in rows]
    width = math.ceil(len(rows) / MAX_STEPS) if rows else 1
    if width > 1:
        steps = steps[::width]
        values = [_column_max(values[i : i + width], n_layers) for i in range(0, len(values), width)]
    return {
        "metric": metric,
        "agg": "max",
        "attempt": None,
        "downsampled": width > 1,
        "steps": steps,
        "layers": list(range(n_layers)),
        "values": values,
    }


def series(spool: SpoolReports, metric: str) -> Json:
    """A run-level scalar over steps, as ``GET .../series`` answers (bucket means, with min and max)."""
    points = [(r.step, v) for r in spool.reports if (v := finite(r.scalars.get(metric))) is not None]
    width = math.ceil(len(points) / MAX_POINTS) if points else 1
    buckets = [points[i : i + width] for i in range(0, len(points), width)]
    return {
        "metric": metric,
        "layer": -1,
        "head": -1,
        "attempt": None,
        "downsampled": width > 1,
        "steps": [b[0][0] for b in buckets],
        "values": [sum(v for _, v in b) / len(b) for b in buckets],
        "min": [min(v for _, v in b) for b in buckets],
        "max": [max(v for _, v in b) for b in buckets],
    }


def latest_values(spool: SpoolReports, metric: str) -> dict[int, tuple[float, int]]:
    """Each layer's last finite value of ``metric`` and its step."""
    out: dict[int, tuple[float, int]] = {}
    for report in spool.reports:
        for layer, value in enumerate(report.layers.get(metric, [])):
            v = finite(value)
            if v is not None:
                out[layer] = (v, report.step)
    return out


def applied_lambdas(spool: SpoolReports) -> Json:
    """The lambdas the run last applied (its ``lambda`` metric), in the shape of ``GET .../lambdas``."""
    last = next((r for r in reversed(spool.reports) if "lambda" in r.layers), None)
    values = [decode_value(v) or 0.0 for v in last.layers["lambda"]] if last is not None else []
    scalars = last.scalars if last is not None else {}
    source = {0.0: "collector", 1.0: "local"}.get(decode_value(scalars.get("lambda_source")) or -1.0)
    version = decode_value(scalars.get("lambda_version"))
    return {
        "lambdas": values,
        "overrides": {},
        "h": [],
        "version": int(version) if version is not None and math.isfinite(version) else "-",
        "step": last.step if last is not None else "-",
        "source": f"the spool: last applied ({source or 'unknown'})",
        "schedule": spool.config.get("schedule") or {},
    }


def _column_max(rows: list[list[float | None]], n: int) -> list[float | None]:
    out: list[float | None] = []
    for j in range(n):
        column = [v for row in rows if (v := row[j]) is not None]
        out.append(max(column) if column else None)
    return out


def source_text(path: Path, spool: SpoolReports) -> str:
    """Where the report was read from, for its header."""
    damaged = f"; {spool.damaged} damaged records skipped" if spool.damaged else ""
    return f"the spool {path} ({spool.ranks} rank(s), {len(spool)} steps; no collector: no alerts{damaged})"
