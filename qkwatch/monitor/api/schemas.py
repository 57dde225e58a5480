"""Response classes (``*Public``): what the API returns, apart from the wire requests and the rows.

Values are wire values: a number, or "nan"/"inf"/"-inf"; null = no point. Routes encode them
with :func:`qkwatch.contract.wire.encode_value` before they get here, so every response is strict JSON.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, computed_field

from qkwatch.contract.wire import RunStatus
from qkwatch.monitor.alerting.records import AlertRow
from qkwatch.monitor.store.events import EventRow
from qkwatch.monitor.store.lambdas import AuditRow
from qkwatch.monitor.store.models import RunRow

Value = float | str | None


def iso(seconds: float | None) -> str | None:
    """Epoch seconds -> ISO 8601 in UTC with milliseconds (``2026-01-02T03:04:05.678+00:00``); None stays None.

    Every time in a response is epoch seconds (``created_at``) with this beside it (``created_at_iso``).
    A time outside what a calendar date can hold (an event's ``time`` is the trainer's) is None.
    """
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return None


class RunPublic(BaseModel):
    id: str
    project: str
    name: str
    status: RunStatus
    status_reason: str | None
    attempt: int
    """The attempt to report under (POST /v1/runs) or the latest attempt (reads)."""
    latest_attempt: int
    config: dict[str, Any]
    tags: list[str]
    """Sorted; ``[]`` when it has none."""
    notes: str | None
    """Free text; null when it has none."""
    created_at: float
    updated_at: float
    last_report_at: float | None
    last_step: int | None

    @computed_field
    def created_at_iso(self) -> str | None:
        return iso(self.created_at)

    @computed_field
    def updated_at_iso(self) -> str | None:
        return iso(self.updated_at)

    @computed_field
    def last_report_at_iso(self) -> str | None:
        return iso(self.last_report_at)

    @classmethod
    def of(cls, row: RunRow, attempt: int | None = None) -> RunPublic:
        return cls(
            id=row.id,
            project=row.project,
            name=row.name,
            status=row.status,
            status_reason=row.status_reason,
            attempt=attempt or row.latest_attempt,
            latest_attempt=row.latest_attempt,
            config=row.config.as_dict(),
            tags=list(row.tags),
            notes=row.notes,
            created_at=row.created_at,
            updated_at=row.updated_at,
            last_report_at=row.last_report_at,
            last_step=row.last_step,
        )


class RunsPublic(BaseModel):
    data: list[RunPublic]
    count: int


class IngestPublic(BaseModel):
    inserted: int
    duplicates: int


class SeriesPublic(BaseModel):
    metric: str
    layer: int
    head: int
    attempt: int | None
    downsampled: bool
    steps: list[int]
    values: list[Value]
    min: list[Value]
    max: list[Value]


class CompareSeriesPublic(BaseModel):
    run: str
    name: str
    project: str
    steps: list[int]
    values: list[Value]
    min: list[Value]
    max: list[Value]


class ComparePublic(BaseModel):
    metric: str
    layer: int
    series: list[CompareSeriesPublic]


class HeatmapPublic(BaseModel):
    metric: str
    agg: str
    attempt: int | None
    downsampled: bool
    steps: list[int]
    layers: list[int]
    values: list[list[Value]]


class LambdasPublic(BaseModel):
    version: int
    step: int | None
    lambdas: list[float]
    overrides: dict[str, float]
    source: str = "schedule"
    h: list[float | None]
    schedule: dict[str, float]


class AuditPublic(BaseModel):
    layer: int
    old: float | None
    new: float | None
    who: str
    at: float
    step: int | None
    version: int

    @computed_field
    def at_iso(self) -> str | None:
        return iso(self.at)

    @classmethod
    def of(cls, row: AuditRow) -> AuditPublic:
        return cls(**row.__dict__)


class AuditListPublic(BaseModel):
    data: list[AuditPublic]
    count: int


class EventPublic(BaseModel):
    attempt: int
    step: int
    kind: str
    message: str
    data: dict[str, Any]
    time: float

    @computed_field
    def time_iso(self) -> str | None:
        return iso(self.time)

    @classmethod
    def of(cls, row: EventRow) -> EventPublic:
        return cls(**row.__dict__)


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


class AlertPublic(BaseModel):
    id: int
    run: str
    run_name: str
    project: str
    rule: str
    severity: str
    state: Literal["firing", "resolved", "ended"]
    """``ended``: the run ended (finished, crashed or stale) while the alert fired; nothing resolved it."""
    metric: str
    layers: list[int]
    summary: str
    onset_step: int
    resolved_step: int | None
    starts_at: float
    ends_at: float | None
    """When it resolved, or when its run ended (state ``ended``); null while it fires."""
    predicted_step: int | None = None
    """A forecast rule's alert: the step at which it predicted, when it fired, that the metric would cross."""
    ended_step: int | None = None
    """State ``ended`` (the run ended while the alert fired): the run's last step."""
    run_end: Literal["finished", "crashed", "stale"] | None = None
    """State ``ended``: how the run ended (``stale``: marked crashed after it went silent)."""
    last_values: list[Value] | None = None
    """State ``ended``: ``metric`` on each of ``layers`` (same order) when the run ended; null for an
    alert that ended before the collector kept them."""

    @computed_field
    def starts_at_iso(self) -> str | None:
        return iso(self.starts_at)

    @computed_field
    def ends_at_iso(self) -> str | None:
        return iso(self.ends_at)

    @classmethod
    def of(cls, row: AlertRow) -> AlertPublic:
        d = dict(row.__dict__)
        d["run"] = d.pop("run_id")
        return cls(**d)


class AlertsPublic(BaseModel):
    data: list[AlertPublic]
    count: int


class HistoryMetricPublic(BaseModel):
    steps: list[int]
    layers: list[int]
    """Layer -1: a run-level scalar."""
    values: list[list[Value]] | None = None
    """One row per step, one value per layer; null: not measured there (``encoding=json``)."""
    values_f64: str | None = None
    """``encoding=f64``: base64 of the steps x layers doubles, little-endian, step-major."""
    measured: str | None = None
    """``encoding=f64``: base64 of one byte per value, 1 = measured; null when all were."""


class HistoryPublic(BaseModel):
    run: str
    project: str
    name: str
    attempt: int | None
    metrics: dict[str, HistoryMetricPublic]


class MetricsListPublic(BaseModel):
    metrics: dict[str, list[int]]


class HealthPublic(BaseModel):
    status: str
    database: str
    version: str
