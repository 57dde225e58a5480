"""The queries of qkwatch's Grafana panels: SQL and PromQL targets, the SQL they share, and a walk over them.

Every SQL query reads the views of migration 0004 (``qkwatch_*_v``), never the tables, and uses no
Grafana macro: points carry steps, not times, so history panels are by step and the time picker
governs only the Prometheus panels and the annotations. Template variables are the only substitutions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qkwatch.dashboards.push import POSTGRES_TYPE, POSTGRES_UID, PROMETHEUS_UID

PG = {"type": POSTGRES_TYPE, "uid": POSTGRES_UID}
PROM = {"type": "prometheus", "uid": PROMETHEUS_UID}


def layer_points(run: str, metric: str) -> str:
    """The layer values of one metric of one run (merged over attempts by the view)."""
    return (
        f"SELECT step, layer, value FROM qkwatch_points_v\n"
        f"  WHERE run_id = '{run}' AND metric = '{metric}' AND head = -1 AND layer >= 0"
    )


AGGREGATES = {
    "max": "max(b.value)",
    # PostgreSQL's avg(double precision) raises "value out of range" on huge finite values (it keeps
    # a sum of squares; values spread by more than about 1e154 overflow it), which would leave the
    # panel an error; the mean over numeric is exact, finite for finite values, and keeps infinities
    # (numeric holds them since PostgreSQL 14).
    "mean": "avg(b.value::numeric)::double precision",
}
"""A bucket's value per layer, by name, as SQL over the bucketed points ``b``."""


def bucketed(points: str, columns: str, agg: str, label: str) -> str:
    """Steps bucketed to at most ``columns`` as the store's heatmap does (width ceil(span / columns)).

    A bucket is named by its first step; each layer gets the ``agg`` (a key of :data:`AGGREGATES`)
    of its values in the bucket (max for the heatmaps: a collapse band is never averaged away).
    Rows come ordered by step and layer, which is the column and row order of the
    grouping-to-matrix transformation.
    """
    return f"""WITH p AS (
  {points}
), w AS (
  SELECT min(step) AS lo, (max(step) - min(step)) / {columns} + 1 AS width FROM p
), b AS (
  SELECT (p.step - w.lo) / w.width AS bucket, p.step, p.layer, p.value FROM p CROSS JOIN w
), s AS (
  SELECT bucket, min(step) AS step FROM b GROUP BY bucket
)
SELECT s.step, {label} AS layer, {AGGREGATES[agg]} AS value
FROM b JOIN s USING (bucket)
GROUP BY s.step, b.layer
ORDER BY s.step, b.layer"""


def layer_label() -> str:
    return "'layer ' || b.layer"


def sql(query: str, ref: str = "A") -> dict[str, Any]:
    return {"refId": ref, "datasource": PG, "editorMode": "code", "format": "table", "rawQuery": True, "rawSql": query}


def promql(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    return {
        "refId": ref,
        "datasource": PROM,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
    }


def iter_queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, datasource uid, query text) of every query: variables, annotations and panel targets."""
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']}", var["datasource"]["uid"], var["query"]
    for anno in board["annotations"]["list"]:
        if "target" in anno:
            yield f"annotation {anno['name']}", anno["datasource"]["uid"], anno["target"]["rawSql"]
    for p in board["panels"]:
        for t in p.get("targets", []):
            uid = t["datasource"]["uid"]
            yield f"panel {p['title']!r} {t['refId']}", uid, t["rawSql"] if uid == POSTGRES_UID else t["expr"]
