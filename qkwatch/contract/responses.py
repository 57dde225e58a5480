"""What the collector's REST API answers: one model per answer, declared once for both sides.

The routers of :mod:`qkwatch.monitor.api` declare them as their ``response_model`` and build them;
:class:`qkwatch.client.Client` parses every answer with them (``RunPublic.of(json)``) and returns
them (under the names ``Run``, ``Alert``, ...). :class:`AlertPublic` is also the collector's own
alert record: its store makes it from the table's rows and its notifier formats it. The names
follow the role (``RunPublic`` one run, ``RunsPublic`` a page of them); the requests are
:mod:`qkwatch.contract.wire`'s and the paths :mod:`qkwatch.contract.api`'s.

Two kinds of field read differently in Python than they travel:

* **Times** travel as epoch seconds. The model keeps those seconds exactly (``created_at_s``, sent
  as ``created_at``, so a bound read back from an answer finds its own run) and reads them as an
  aware UTC datetime under the wire's name (``run.created_at``); each also travels as ISO 8601
  (``created_at_iso``).
* **Values** travel as numbers or ``"nan"``, ``"inf"``, ``"-inf"`` (null: not measured) and are
  floats here (:data:`~qkwatch.contract.answer_base.Value`), written back the same way.

Indexing an answer reads its JSON: ``run["created_at"]`` is epoch seconds, ``series["values"]``
holds ``"nan"`` strings, ``page["data"]`` is a list of dicts (:mod:`qkwatch.contract.answer_base`).
A list answer is a :class:`~qkwatch.contract.answer_base.Page`: ``data``, ``count``, and iterating
it gives ``data``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, computed_field, model_validator

from qkwatch.contract.answer_base import Answer, Page, Value, collector_time, iso, utc
from qkwatch.contract.wire import RunStatus

__all__ = [
    "AlertPublic",
    "AlertsPublic",
    "Answer",
    "AuditListPublic",
    "AuditPublic",
    "ComparePublic",
    "CompareSeriesPublic",
    "EventPublic",
    "EventsPublic",
    "HealthPublic",
    "HeatmapPublic",
    "HistoryMetricPublic",
    "HistoryPublic",
    "IngestPublic",
    "LambdasPublic",
    "MetricsListPublic",
    "Page",
    "RunPublic",
    "RunsPublic",
    "SeriesPublic",
    "Value",
]


class RunPublic(Answer):
    """One run; ``attempt`` is the attempt to report under (``POST /v1/runs``) or the latest (reads)."""

    id: str
    project: str
    name: str
    status: RunStatus
    status_reason: str | None
    attempt: int
    latest_attempt: int
    config: dict[str, Any]
    tags: tuple[str, ...]
    """Sorted; empty when it has none."""
    notes: str | None
    """Free text; None when it has none."""
    created_at_s: float = Field(alias="created_at")
    updated_at_s: float = Field(alias="updated_at")
    last_report_at_s: float | None = Field(alias="last_report_at")
    last_step: int | None

    @model_validator(mode="before")
    @classmethod
    def _before_tags(cls, data: Any) -> Any:
        """A collector older than tags and notes sends neither: none of them."""
        if isinstance(data, dict) and not {"tags", "notes"} <= data.keys():
            return {"tags": (), "notes": None, **data}
        return data

    @computed_field
    def created_at_iso(self) -> str | None:
        return iso(self.created_at_s)

    @computed_field
    def updated_at_iso(self) -> str | None:
        return iso(self.updated_at_s)

    @computed_field
    def last_report_at_iso(self) -> str | None:
        return iso(self.last_report_at_s)

    @property
    def created_at(self) -> datetime:
        return collector_time(self.created_at_s)

    @property
    def updated_at(self) -> datetime:
        return collector_time(self.updated_at_s)

    @property
    def last_report_at(self) -> datetime | None:
        return utc(self.last_report_at_s)

    @property
    def ref(self) -> str:
        """``project/name``: the run's name everywhere a run is taken."""
        return f"{self.project}/{self.name}"


class RunsPublic(Page[RunPublic]):
    """A page of runs (``GET /v1/runs``)."""


class IngestPublic(Answer):
    """The points a batch stored, and those already there (stored once before)."""

    inserted: int
    duplicates: int


class SeriesPublic(Answer):
    """One layer's (or head's) values over steps; when ``downsampled``, each a bucket's mean, min and max."""

    metric: str
    layer: int
    head: int
    attempt: int | None
    downsampled: bool
    steps: list[int]
    values: list[Value]
    min: list[Value]
    max: list[Value]


class CompareSeriesPublic(Answer):
    run: str
    name: str
    project: str
    steps: list[int]
    values: list[Value]
    min: list[Value]
    max: list[Value]


class ComparePublic(Answer):
    metric: str
    layer: int
    series: list[CompareSeriesPublic]


class HeatmapPublic(Answer):
    metric: str
    agg: str
    attempt: int | None
    downsampled: bool
    steps: list[int]
    layers: list[int]
    values: list[list[Value]]
    """One row per step (bucket), one value per layer."""


class LambdasPublic(Answer):
    version: int
    step: int | None
    lambdas: list[float]
    overrides: dict[int, float]
    source: str = "schedule"
    h: list[float | None]
    """Each layer's running attention entropy (None before its first)."""
    schedule: dict[str, float]


class AuditPublic(Answer):
    """One change of a lambda override."""

    layer: int
    old: float | None
    new: float | None
    who: str
    at_s: float = Field(alias="at")
    step: int | None
    version: int

    @computed_field
    def at_iso(self) -> str | None:
        return iso(self.at_s)

    @property
    def at(self) -> datetime:
        return collector_time(self.at_s)


class AuditListPublic(Page[AuditPublic]):
    """A page of lambda audit entries (``GET /v1/runs/{id}/lambdas/audit``)."""


class EventPublic(Answer):
    attempt: int
    step: int
    kind: str
    message: str
    data: dict[str, Any]
    time_s: float = Field(alias="time")
    """The trainer's time of the report that carried it."""

    @computed_field
    def time_iso(self) -> str | None:
        return iso(self.time_s)

    @property
    def time(self) -> datetime | None:
        """None for a time no calendar date holds (the trainer's clock)."""
        return utc(self.time_s)


class EventsPublic(Page[EventPublic]):
    """A page of a run's events (``GET /v1/runs/{id}/events``)."""


class AlertPublic(Answer):
    """One alert of one run: firing, resolved, or ``ended``: its run ended (finished, crashed or went
    stale) while it fired and nothing resolved it; then ``ended_step``, ``run_end`` and
    ``last_values`` say where, how and with which values."""

    id: int
    run: str
    """The run's id."""
    run_name: str
    project: str
    rule: str
    severity: str
    state: Literal["firing", "resolved", "ended"]
    metric: str
    layers: list[int]
    summary: str
    onset_step: int
    resolved_step: int | None
    """Set once it resolved."""
    starts_at_s: float = Field(alias="starts_at")
    ends_at_s: float | None = Field(alias="ends_at")
    """When it resolved, or when its run ended (state ``ended``); None while it fires."""
    predicted_step: int | None = None
    """A forecast rule's alert: the step at which it predicted, when it fired, that the metric would cross."""
    ended_step: int | None = None
    """State ``ended``: the run's last step."""
    run_end: Literal["finished", "crashed", "stale"] | None = None
    """State ``ended``: how the run ended (``stale``: marked crashed after it went silent)."""
    last_values: list[Value] | None = None
    """State ``ended``: ``metric`` on each of ``layers`` (same order) when the run ended; None for an
    alert that ended before the collector kept them."""

    @computed_field
    def starts_at_iso(self) -> str | None:
        return iso(self.starts_at_s)

    @computed_field
    def ends_at_iso(self) -> str | None:
        return iso(self.ends_at_s)

    @property
    def starts_at(self) -> datetime:
        return collector_time(self.starts_at_s)

    @property
    def ends_at(self) -> datetime | None:
        return utc(self.ends_at_s)

    @property
    def ended_while_firing(self) -> bool:
        """The run ended while this alert fired (state ``ended``): not resolved."""
        return self.state == "ended"


class AlertsPublic(Page[AlertPublic]):
    """A page of alerts (``GET /v1/alerts``)."""


class HistoryMetricPublic(Answer):
    steps: list[int]
    layers: list[int]
    """Layer -1: a run-level scalar."""
    values: list[list[Value]] | None = None
    """One row per step, one value per layer; None: not measured there (``encoding=json``)."""
    values_f64: str | None = None
    """``encoding=f64``: base64 of the steps x layers doubles, little-endian, step-major."""
    measured: str | None = None
    """``encoding=f64``: base64 of one byte per value, 1 = measured; None when all were."""


class HistoryPublic(Answer):
    """Every layer value and run-level scalar of the metrics asked for, step by step."""

    run: str
    project: str
    name: str
    attempt: int | None
    metrics: dict[str, HistoryMetricPublic]


class MetricsListPublic(Answer):
    metrics: dict[str, list[int]]
    """Metric name -> the layers that reported it (``[-1]``: a run-level scalar)."""


class HealthPublic(Answer):
    status: str
    database: str
    version: str
