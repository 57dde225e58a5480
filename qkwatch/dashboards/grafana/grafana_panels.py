"""The builders of qkwatch's Grafana dashboards: panels, queries, template variables, plain dicts.

``boards.py`` composes the two dashboards from these. Every SQL query reads the views of
migration 0004 (``qkwatch_*_v``); a panel's ``gridPos`` comes from a :class:`Layout`, which places
panels left to right on Grafana's 24-column grid.
"""

from __future__ import annotations

from typing import Any

from qkwatch.monitor.dashboards import POSTGRES_TYPE, POSTGRES_UID, PROMETHEUS_UID

PG = {"type": POSTGRES_TYPE, "uid": POSTGRES_UID}
PROM = {"type": "prometheus", "uid": PROMETHEUS_UID}
SCHEMA_VERSION = 39


def thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


# --- SQL -------------------------------------------------------------------------------------


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


# --- panels ----------------------------------------------------------------------------------


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new line."""

    def __init__(self) -> None:
        self.x = self.y = self.line = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.line = 0, self.y + self.line, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.line = max(self.line, h)
        return pos

    def row(self, title: str) -> dict[str, Any]:
        if self.x:
            self.x, self.y, self.line = 0, self.y + self.line, 0
        panel = {
            "type": "row",
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            "id": self.take_id(),
            "panels": [],
        }
        self.y += 1
        return panel

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def panel(
    layout: Layout,
    kind: str,
    title: str,
    w: int,
    h: int,
    targets: list[dict[str, Any]],
    *,
    description: str = "",
    defaults: dict[str, Any] | None = None,
    overrides: list[Any] | None = None,
    options: dict[str, Any] | None = None,
    transformations: list[Any] | None = None,
) -> dict[str, Any]:
    datasource = targets[0]["datasource"]
    out: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "id": layout.take_id(),
        "gridPos": layout.place(w, h),
        "datasource": datasource,
        "targets": targets,
        "fieldConfig": {"defaults": defaults or {}, "overrides": overrides or []},
        "options": options or {},
    }
    if transformations:
        out["transformations"] = transformations
    return out


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


def band_matrix(
    layout: Layout,
    title: str,
    run: str,
    metric: str,
    color: dict[str, Any],
    *,
    description: str,
    w: int = 24,
    h: int = 9,
    unit: str = "none",
    decimals: int = 2,
) -> dict[str, Any]:
    """A layer x step heatmap as a table: one row per layer, one column per step bucket, coloured cells."""
    query = bucketed(layer_points(run, metric), "$columns", "max", layer_label())
    defaults = {
        "custom": {
            "align": "center",
            "cellOptions": {"type": "color-background", "mode": "basic"},
            "inspect": False,
            "minWidth": 44,
        },
        "decimals": decimals,
        "unit": unit,
        **color,
    }
    first_column = [
        {
            "matcher": {"id": "byType", "options": "string"},
            "properties": [
                {"id": "custom.cellOptions", "value": {"type": "auto"}},
                {"id": "custom.width", "value": 76},
                {"id": "custom.align", "value": "left"},
            ],
        }
    ]
    return panel(
        layout,
        "table",
        title,
        w,
        h,
        [sql(query)],
        description=description,
        defaults=defaults,
        overrides=first_column,
        options={"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}},
        transformations=[
            {
                "id": "groupingToMatrix",
                "options": {"columnField": "step", "rowField": "layer", "valueField": "value", "emptyValue": "null"},
            }
        ],
    )


def layer_trend(
    layout: Layout,
    title: str,
    run: str,
    metric: str,
    *,
    description: str,
    w: int = 12,
    h: int = 8,
    steps: list[Any] | None = None,
    unit: str = "none",
) -> dict[str, Any]:
    """Each layer's value over steps (trend panel: the x axis is the step, not time)."""
    query = bucketed(layer_points(run, metric), "400", "mean", layer_label())
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": True,
        "fillOpacity": 0,
        "thresholdsStyle": {"mode": "dashed" if steps else "off"},
    }
    defaults = {
        "custom": custom,
        "color": {"mode": "palette-classic"},
        "unit": unit,
        "thresholds": thresholds(steps or [(None, "transparent")]),
    }
    return panel(
        layout,
        "trend",
        title,
        w,
        h,
        [sql(query)],
        description=description,
        defaults=defaults,
        options={
            "xField": "step",
            "legend": {"showLegend": True, "displayMode": "list", "placement": "right"},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        transformations=[
            {
                "id": "groupingToMatrix",
                "options": {"columnField": "layer", "rowField": "step", "valueField": "value", "emptyValue": "null"},
            },
            # The matrix names its row field "step\layer" and makes it a string; the trend
            # panel's x axis must be a number.
            {"id": "organize", "options": {"renameByName": {"step\\layer": "step"}}},
            {
                "id": "convertFieldType",
                "options": {"fields": {}, "conversions": [{"targetField": "step", "destinationType": "number"}]},
            },
        ],
    )


def timeseries(
    layout: Layout,
    title: str,
    targets: list[dict[str, Any]],
    *,
    description: str,
    w: int = 12,
    h: int = 8,
    unit: str = "none",
    steps: list[Any] | None = None,
    min_value: float | None = None,
) -> dict[str, Any]:
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": True,
        "fillOpacity": 0,
        "thresholdsStyle": {"mode": "dashed+area" if steps else "off"},
    }
    defaults: dict[str, Any] = {
        "custom": custom,
        "color": {"mode": "palette-classic"},
        "unit": unit,
        "thresholds": thresholds(steps or [(None, "transparent")]),
    }
    if min_value is not None:
        defaults["min"] = min_value
    return panel(
        layout,
        "timeseries",
        title,
        w,
        h,
        targets,
        description=description,
        defaults=defaults,
        options={
            "legend": {"showLegend": True, "displayMode": "list", "placement": "right"},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def stat(
    layout: Layout,
    title: str,
    target: dict[str, Any],
    *,
    description: str,
    w: int = 4,
    h: int = 4,
    unit: str = "none",
    steps: list[Any] | None = None,
    decimals: int | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": thresholds(steps or [(None, "text")]),
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return panel(
        layout,
        "stat",
        title,
        w,
        h,
        [target],
        description=description,
        defaults=defaults,
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background" if steps else "value",
            "graphMode": "none",
            "textMode": "value_and_name",
            "justifyMode": "auto",
            "orientation": "auto",
        },
    )


def table(
    layout: Layout,
    title: str,
    query: str,
    *,
    description: str,
    w: int = 24,
    h: int = 8,
    overrides: list[Any] | None = None,
) -> dict[str, Any]:
    return panel(
        layout,
        "table",
        title,
        w,
        h,
        [sql(query)],
        description=description,
        defaults={"custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False}},
        overrides=overrides,
        options={"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}},
    )


def colour_cells(name: str, steps: list[Any]) -> dict[str, Any]:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "custom.cellOptions", "value": {"type": "color-background", "mode": "basic"}},
            {"id": "color", "value": {"mode": "thresholds"}},
            {"id": "thresholds", "value": thresholds(steps)},
            {"id": "decimals", "value": 2},
        ],
    }


def status_cells(name: str = "status") -> dict[str, Any]:
    mapping = {"running": ("blue", 0), "finished": ("green", 1), "crashed": ("red", 2)}
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "custom.cellOptions", "value": {"type": "color-text"}},
            {
                "id": "mappings",
                "value": [{"type": "value", "options": {k: {"color": c, "index": i} for k, (c, i) in mapping.items()}}],
            },
        ],
    }


def alert_state_cells(name: str = "state") -> dict[str, Any]:
    """An alert's state in colour; "ended" reads "run ended while firing" (in orange), never as resolved."""
    options = {
        "firing": {"color": "red", "index": 0},
        "ended": {"color": "orange", "index": 1, "text": "run ended while firing"},
        "resolved": {"color": "green", "index": 2},
    }
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "custom.cellOptions", "value": {"type": "color-text"}},
            {"id": "mappings", "value": [{"type": "value", "options": options}]},
        ],
    }


def time_cells(*names: str) -> list[dict[str, Any]]:
    return [
        {"matcher": {"id": "byName", "options": n}, "properties": [{"id": "unit", "value": "dateTimeAsIso"}]}
        for n in names
    ]


# --- template variables and the dashboard ---------------------------------------------


def query_variable(name: str, label: str, query: str, *, hide: int = 0, refresh: int = 1) -> dict[str, Any]:
    """A variable filled by a SQL query (refresh 1: on load; 2: on time range change)."""
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": PG,
        "query": query,
        "definition": query,
        "refresh": refresh,
        "hide": hide,
        "sort": 0,
        "multi": False,
        "includeAll": False,
        "current": {},
        "options": [],
        "regex": "",
        "skipUrlSync": False,
    }


def custom_variable(name: str, label: str, values: list[str], default: str) -> dict[str, Any]:
    return {
        "type": "custom",
        "name": name,
        "label": label,
        "query": ",".join(values),
        "hide": 0,
        "multi": False,
        "includeAll": False,
        "skipUrlSync": False,
        "current": {"selected": True, "text": default, "value": default},
        "options": [{"selected": v == default, "text": v, "value": v} for v in values],
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[Any],
    variables: list[Any],
    annotations: list[Any] | None = None,
    time_from: str = "now-6h",
) -> dict[str, Any]:
    builtin = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["qkwatch"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": time_from, "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "links": [
            {
                "type": "dashboards",
                "tags": ["qkwatch"],
                "asDropdown": False,
                "includeVars": False,
                "keepTime": True,
                "title": "qkwatch",
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {"list": [builtin, *(annotations or [])]},
        "templating": {"list": variables},
        "panels": panels,
    }


def sql_annotation(name: str, color: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "datasource": PG,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "target": {**sql(query, "Anno")},
    }
