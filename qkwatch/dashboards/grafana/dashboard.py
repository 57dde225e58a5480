"""The dashboard around qkwatch's Grafana panels: schema version, links, annotations and variables."""

from __future__ import annotations

from typing import Any

from qkwatch.dashboards.grafana.queries import PG, sql

SCHEMA_VERSION = 39


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
