"""The colours of qkwatch's Grafana panels: threshold steps, and the discrete scales around a break.

The scales are the live page's (:mod:`qkwatch.contract.colour_scale`), so a layer reads the same colour
in Grafana as on the collector's page.
"""

from __future__ import annotations

from typing import Any

from qkwatch.contract import colour_scale
from qkwatch.contract.thresholds import Thresholds

# Discrete colour steps around a threshold t, as offsets from t, on the live page's scale
# (qkwatch.contract.colour_scale): light and calm far below t, straw from 0.15 below ("approaching"),
# orange to dark red above, so 0.68 and 0.72 never look alike around a break at 0.70.
QKAI_EDGES = (-0.35, -0.15, 0.0, 0.1, 0.2)
ENTROPY_EDGES = (-0.35, -0.15, 0.0, 0.1)


def thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


def qkai_steps(t: Thresholds) -> list[tuple[float | None, str]]:
    return colour_scale.discrete(t.collapse, QKAI_EDGES)
