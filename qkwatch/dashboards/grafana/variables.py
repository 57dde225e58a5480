"""The template variables of qkwatch's Grafana dashboards: SQL-filled and fixed-choice ones."""

from __future__ import annotations

from typing import Any

from qkwatch.dashboards.grafana.queries import PG

RUNS_BY_ACTIVITY = (
    "SELECT project || ' / ' || run_name AS __text, run_id AS __value FROM qkwatch_runs_v\n"
    "ORDER BY coalesce(last_report_at, created_at) DESC"
)


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
