"""The panels of qkwatch's Grafana dashboards: the generic :func:`panel` and the kinds built on it.

A panel's ``gridPos`` and ``id`` come from a :class:`~qkwatch.dashboards.grafana.layout.Layout`.
History panels are by step, not time (table heatmaps and trend panels whose x axis is the step).
"""

from __future__ import annotations

from typing import Any

from qkwatch.dashboards.grafana.colours import thresholds
from qkwatch.dashboards.grafana.layout import Layout
from qkwatch.dashboards.grafana.queries import bucketed, layer_label, layer_points, sql


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
