"""Field overrides for the columns of qkwatch's Grafana tables: coloured cells, value mappings, time units."""

from __future__ import annotations

from typing import Any

from qkwatch.dashboards.grafana.colours import thresholds


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
