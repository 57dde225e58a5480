"""The wire schema between the agent and the collector (pydantic and the standard library only).

The agent imports this module, so it must never import FastAPI, SQLAlchemy or anything of the
collector's. Responses have their own ``*Public`` classes in ``monitor.api.schemas``.

Values: a JSON number, or one of the strings ``"nan"``, ``"inf"``, ``"-inf"``; ``null`` means
"not measured" and is never stored. In Python a value is a ``float`` (possibly non-finite) or
``None``: :func:`decode_value` and :func:`encode_value` convert between the two, and the models
below serialise non-finite floats as those strings, so ``model_dump(mode="json")`` is strict JSON.
"""

from __future__ import annotations

import math
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, Strict, field_serializer, field_validator

NonFinite = Literal["nan", "inf", "-inf"]
Number = Annotated[float, Strict()]
"""A JSON number (an int is fine); strict, so "0.1" or true is refused rather than converted."""
WireValue = Number | NonFinite | None
"""What a value may look like on the wire (and in Python before decoding)."""

_DECODE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
METRIC_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}$"
MetricName = Annotated[str, Field(pattern=METRIC_NAME_PATTERN)]
NAME_PATTERN = r"^[^\s/\x00-\x1f\x7f]+$"
"""Project and run names: no whitespace, slash or control characters."""


def decode_value(value: float | str | None) -> float | None:
    """Wire value -> float (non-finite allowed) or None ("not measured")."""
    if value is None or isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return _DECODE[value]
        except KeyError:
            raise ValueError(f"value {value!r} is neither a number nor one of 'nan', 'inf', '-inf'") from None
    if isinstance(value, bool):
        raise ValueError("a boolean is not a value")
    return float(value)


def encode_value(value: float | None) -> float | str | None:
    """Float (or None) -> strict-JSON wire value: non-finite floats become "nan", "inf", "-inf"."""
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _encode_nested(value: Any) -> Any:
    if isinstance(value, float):
        return encode_value(value)
    if isinstance(value, list):
        return [_encode_nested(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode_nested(v) for k, v in value.items()}
    return value


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Event(_Wire):
    """Something the agent wants on the record at a step (e.g. kind "missing_layers")."""

    kind: MetricName
    message: str = Field(default="", max_length=4096)
    data: dict[str, Any] = Field(default_factory=dict)


class Report(_Wire):
    """One step of one run: per-layer values, optional per-head values, run-level scalars, events."""

    step: Annotated[int, Strict()] = Field(ge=0, le=2**62)
    time: Number = Field(description="Unix seconds when the step was measured.")
    layers: dict[MetricName, list[WireValue]] = Field(default_factory=dict)
    heads: dict[MetricName, list[list[WireValue] | None]] = Field(default_factory=dict)
    scalars: dict[MetricName, WireValue] = Field(default_factory=dict)
    events: list[Event] = Field(default_factory=list)

    @field_validator("time")
    @classmethod
    def _finite_time(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("time must be a finite number of seconds")
        return value

    @field_serializer("layers", "heads", "scalars")
    def _strict_json(self, value: Any) -> Any:
        return _encode_nested(value)

    def point_count(self) -> int:
        """Number of stored points this report carries (nulls are not points)."""
        n = sum(v is not None for values in self.layers.values() for v in values)
        n += sum(v is not None for per_layer in self.heads.values() for hs in per_layer if hs for v in hs)
        return n + sum(v is not None for v in self.scalars.values())


class ReportBatch(_Wire):
    """``POST /v1/runs/{id}/reports``: stored whole or not at all, once per ``batch_id``."""

    batch_id: uuid.UUID
    attempt: int | None = Field(default=None, ge=1, le=2**31 - 1, description="Default: the run's latest attempt.")
    reports: list[Report] = Field(min_length=1)

    def point_count(self) -> int:
        return sum(r.point_count() for r in self.reports)


class RunCreate(_Wire):
    """``POST /v1/runs``: create, or resume (same project and name), a run."""

    project: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    config: dict[str, Any] = Field(default_factory=dict)
    attempt_key: str | None = Field(default=None, min_length=1, max_length=200)


RunStatus = Literal["running", "finished", "crashed"]


STATUS_REASON_MAX = 200
"""Longest status reason the collector stores (the agent truncates longer ones)."""


class StatusPatch(_Wire):
    """``PATCH /v1/runs/{id}``: how the run ended, e.g. ``{"status": "crashed", "reason": "RuntimeError: ..."}``.

    The agent sends it after the run's last report; it is idempotent, so a replay (``qkwatch sync``)
    is harmless. ``attempt`` names the attempt that ended: a status of an attempt older than the
    run's latest (a resumed run's earlier process, delivered late) is ignored, so it cannot mark
    the running attempt crashed.
    """

    status: RunStatus
    reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=STATUS_REASON_MAX,
        description="Stored as status_reason (default: patch).",
    )
    attempt: int | None = Field(default=None, ge=1, le=2**31 - 1, description="Default: the run's latest attempt.")


class OverridesPut(RootModel[dict[str, Number | None]]):
    """``PUT /v1/runs/{id}/lambdas/overrides``: ``{"3": 0.0, "12": 0.5}``; null removes an override.

    Keys are layer indices as strings. The server checks each value against the run's
    ``lambda_max`` (finite, 0 <= value <= lambda_max) and the index against the layer count.
    """
