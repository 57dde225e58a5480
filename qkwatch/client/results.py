"""The typed results of the collector's REST API, as :class:`qkwatch.client.rest.Client` returns them.

Frozen dataclasses whose times are timezone-aware datetimes (UTC) and whose values are floats, NaN
and infinities decoded from the wire's ``"nan"``/``"inf"``/``"-inf"`` (None: not measured). A list
answer is a :class:`Page` (``data``, ``count``; iterating it gives ``data``). Indexing a result reads
the JSON the collector sent: ``run["created_at"]`` is epoch seconds, ``series["values"]`` holds
``"nan"`` strings, ``page["data"]`` is a list of dicts.

A history answer becomes columns in :mod:`qkwatch.client.history_grid`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

from qkwatch.contract.values import decode_value

R = TypeVar("R", bound="Result")


def _time(seconds: float | None) -> datetime | None:
    """Epoch seconds -> an aware UTC datetime; None for None or a time no calendar holds."""
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


def _floats(values: Iterable[Any]) -> list[float | None]:
    return [decode_value(v) for v in values]


@dataclass(frozen=True, kw_only=True, eq=False)
class Result:
    """Base of the typed results: attributes are typed; ``result["key"]`` is the JSON as sent
    (``dict(result)`` too)."""

    raw: dict[str, Any] = field(repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __eq__(self, other: object) -> bool:
        """Equal to a result of the same kind, or to a dict, holding the same JSON."""
        if isinstance(other, dict):
            return self.raw == other
        return type(other) is type(self) and self.raw == other.raw

    __hash__ = None  # type: ignore[assignment]  # mutable JSON inside, like a dict

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def keys(self) -> Iterable[str]:
        return self.raw.keys()

    @classmethod
    def of(cls: type[R], raw: dict[str, Any]) -> R:
        """The typed result of a JSON answer: fields named as in the answer, times and values decoded."""
        names = {f.name for f in fields(cls)} - {"raw"}
        return cls(raw=raw, **{k: cls._decode(k, v) for k, v in raw.items() if k in names})

    @staticmethod
    def _decode(key: str, value: Any) -> Any:
        return value


_TIMES = frozenset({"created_at", "updated_at", "last_report_at", "starts_at", "ends_at", "time", "at"})


def _timed(key: str, value: Any) -> Any:
    return _time(value) if key in _TIMES else value


def _run_field(key: str, value: Any) -> Any:
    if key == "tags":
        return tuple(value)
    return _timed(key, value)


@dataclass(frozen=True, kw_only=True, eq=False)
class Run(Result):
    id: str
    project: str
    name: str
    status: str
    status_reason: str | None
    attempt: int
    """From ``create_run``: the attempt to report under; otherwise the latest attempt."""
    latest_attempt: int
    config: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    last_report_at: datetime | None
    last_step: int | None
    tags: tuple[str, ...] = ()
    """Sorted (a collector older than tags sends none: empty)."""
    notes: str | None = None
    """Free text; None when the run has none."""

    _decode = staticmethod(_run_field)

    @property
    def ref(self) -> str:
        """``project/name``: the run's name everywhere a run is taken."""
        return f"{self.project}/{self.name}"


def _alert_field(key: str, value: Any) -> Any:
    if key == "last_values":
        return None if value is None else _floats(value)
    return _timed(key, value)


@dataclass(frozen=True, kw_only=True, eq=False)
class Alert(Result):
    """One alert. ``state`` is "firing", "resolved", or "ended": its run ended (finished, crashed or
    went stale) while it fired, and nothing resolved it; then ``ended_step``, ``run_end`` and
    ``last_values`` say where, how and with which values."""

    id: int
    run: str
    run_name: str
    project: str
    rule: str
    severity: str
    state: str
    metric: str
    layers: list[int]
    summary: str
    onset_step: int
    resolved_step: int | None
    starts_at: datetime
    ends_at: datetime | None
    """When it resolved, or when its run ended; None while it fires."""
    predicted_step: int | None = None
    """A forecast rule's alert: the step at which it predicted the crossing when it fired."""
    ended_step: int | None = None
    """State "ended": the run's last step."""
    run_end: str | None = None
    """State "ended": "finished", "crashed" or "stale"."""
    last_values: list[float | None] | None = None
    """State "ended": ``metric`` on each of ``layers`` when the run ended (NaN decoded; None: not kept)."""

    _decode = staticmethod(_alert_field)

    @property
    def ended_while_firing(self) -> bool:
        """The run ended while this alert fired (state "ended"): not resolved."""
        return self.state == "ended"


@dataclass(frozen=True, kw_only=True, eq=False)
class Event(Result):
    attempt: int
    step: int
    kind: str
    message: str
    data: dict[str, Any]
    time: datetime | None
    """The trainer's time of the report that carried it."""

    _decode = staticmethod(_timed)


@dataclass(frozen=True, kw_only=True, eq=False)
class AuditEntry(Result):
    layer: int
    old: float | None
    new: float | None
    who: str
    at: datetime
    step: int | None
    version: int

    _decode = staticmethod(_timed)


def _valued(key: str, value: Any) -> Any:
    if key in ("values", "min", "max", "lambdas", "h"):
        return [_floats(v) if isinstance(v, list) else decode_value(v) for v in value]
    if key == "overrides":
        return {int(k): decode_value(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, kw_only=True, eq=False)
class Series(Result):
    metric: str
    layer: int
    head: int
    attempt: int | None
    downsampled: bool
    steps: list[int]
    values: list[float]
    """The value at each step (the bucket mean when ``downsampled``)."""
    min: list[float]
    max: list[float]

    _decode = staticmethod(_valued)


@dataclass(frozen=True, kw_only=True, eq=False)
class Heatmap(Result):
    metric: str
    agg: str
    attempt: int | None
    downsampled: bool
    steps: list[int]
    layers: list[int]
    values: list[list[float | None]]
    """One row per step (bucket), one value per layer; None: not measured."""

    _decode = staticmethod(_valued)


@dataclass(frozen=True, kw_only=True, eq=False)
class CompareSeries(Result):
    run: str
    name: str
    project: str
    steps: list[int]
    values: list[float]
    min: list[float]
    max: list[float]

    _decode = staticmethod(_valued)


@dataclass(frozen=True, kw_only=True, eq=False)
class Compare(Result):
    metric: str
    layer: int
    series: list[CompareSeries]

    @staticmethod
    def _decode(key: str, value: Any) -> Any:
        return [CompareSeries.of(s) for s in value] if key == "series" else value


@dataclass(frozen=True, kw_only=True, eq=False)
class Lambdas(Result):
    version: int
    step: int | None
    lambdas: list[float]
    overrides: dict[int, float]
    source: str
    h: list[float | None]
    """Each layer's running attention entropy (None before its first)."""
    schedule: dict[str, float]

    _decode = staticmethod(_valued)


@dataclass(frozen=True, kw_only=True, eq=False)
class RunMetrics(Result):
    metrics: dict[str, list[int]]
    """Metric name -> the layers that reported it (``[-1]``: a run-level scalar)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class Ingested(Result):
    inserted: int
    duplicates: int


@dataclass(frozen=True, kw_only=True, eq=False)
class Health(Result):
    status: str
    database: str
    version: str


T = TypeVar("T", bound=Result)


@dataclass(frozen=True, kw_only=True, eq=False)
class Page(Generic[T]):
    """A list answer: ``data`` (this page) and ``count`` (all matches); iterating gives ``data``."""

    data: list[T]
    count: int
    raw: dict[str, Any] = field(repr=False, compare=False)

    def __iter__(self) -> Iterator[T]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | str) -> Any:
        """``page[0]``: the first typed item; ``page["data"]``: the JSON as sent."""
        return self.raw[key] if isinstance(key, str) else self.data[key]

    __eq__ = Result.__eq__
    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def of(cls, raw: dict[str, Any], item: type[T]) -> Page[T]:
        return cls(data=[item.of(d) for d in raw["data"]], count=raw["count"], raw=raw)
