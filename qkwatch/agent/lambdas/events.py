"""The words of the agent's lambda events and warnings: what the collector asked, and what was applied.

Pure functions of :mod:`qkwatch.agent.lambdas.lambdas`' records; an event's values are strict JSON, in a
double's range and briefly quoted, so that an event never gets a report refused.
"""

from __future__ import annotations

from typing import Any

from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.contract.values import brief, encode_value


def describe(
    kind: str, layer: int | None, requested: Any, applied: Any, n_layers: int, schedule: ScheduleConfig
) -> str:
    """The warning of a clipped, replaced or refused collector lambda."""
    if kind == "lambdas_refused":
        return (
            f"refusing the collector's lambdas: {requested} values for {n_layers} layers cannot be mapped "
            "to layers; keeping the last good values"
        )
    if kind == "lambda_clipped":
        return (
            f"the collector's lambda {requested!r} for layer {layer} is above lambda_max={schedule.lambda_max}; "
            f"clipped to {applied!r}"
        )
    return (
        f"the collector's lambda {requested!r} for layer {layer} is not a finite number >= 0; "
        "using the local schedule's value"
    )


def requested_value(value: Any) -> Any:
    """A requested value as an event may carry it: strict JSON, a float's range, a few characters."""
    if isinstance(value, float):
        return encode_value(value)
    if value is None or isinstance(value, bool) or (isinstance(value, int) and abs(value) < 2**53):
        return value
    if isinstance(value, str) and len(value) <= 60:
        return value
    return brief(value)


def changed_event(items: list[dict[str, Any]]) -> dict[str, Any]:
    """``lambda_changed``: each layer's collector lambda from, to, and what was asked when the bound held it back."""
    held = [i["layer"] for i in items if "requested" in i]
    message = f"collector lambdas of layers {[i['layer'] for i in items]} changed"
    if held:
        message += f"; layers {held} held to lambda_max_change per exchange"
    return {"kind": "lambda_changed", "message": message, "data": {"layers": items}}


def event(kind: str, items: list[dict[str, Any]], lambda_max: float) -> dict[str, Any]:
    """One report event of a kind (``lambda_clipped``, ``lambda_invalid``, ``lambdas_refused``), listing its layers."""
    if kind == "lambdas_refused":
        message = f"collector lambdas refused: wrong length ({', '.join(str(i['requested']) for i in items)})"
        return {"kind": kind, "message": message, "data": {"refused": items}}
    layers = [i["layer"] for i in items]
    what = "clipped to lambda_max" if kind == "lambda_clipped" else "replaced by the local schedule"
    message = f"collector lambdas of layers {layers} {what}"
    return {"kind": kind, "message": message, "data": {"layers": items, "lambda_max": lambda_max}}
