"""The wire schema between the agent and the collector (pydantic and the standard library only).

The agent imports this module, so it must never import FastAPI, SQLAlchemy or anything of the
collector's but the pure :mod:`qkwatch.monitor.scheduling`. Responses have their own ``*Public``
classes in ``monitor.api.schemas``.

Values: a JSON number, or one of the strings ``"nan"``, ``"inf"``, ``"-inf"``; ``null`` means
"not measured" and is never stored. In Python a value is a ``float`` (possibly non-finite) or
``None``: :func:`decode_value` and :func:`encode_value` convert between the two, and the models
below serialise non-finite floats as those strings, so ``model_dump(mode="json")`` is strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    RootModel,
    Strict,
    TypeAdapter,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)

from qkwatch.monitor.scheduling import ScheduleConfig

NonFinite = Literal["nan", "inf", "-inf"]
Number = Annotated[float, Strict()]
"""A JSON number (an int is fine); strict, so "0.1" or true is refused rather than converted."""
WireValue = Number | NonFinite | None
"""What a value may look like on the wire (and in Python before decoding)."""

_DECODE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
METRIC_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}$"
MetricName = Annotated[str, Field(pattern=METRIC_NAME_PATTERN)]
_METRIC_NAME = re.compile(METRIC_NAME_PATTERN)


def clean_metric_name(name: str) -> str:
    """``name`` in the metric alphabet (``[A-Za-z_][A-Za-z0-9_.:/-]``, at most 128 characters).

    A report with a name outside it is refused, and with it the batch it rides in, so senders
    clean names first: every other character becomes ``_`` (``"val acc"`` -> ``"val_acc"``), and a
    leading digit or sign gets a ``_`` in front.
    """
    if _METRIC_NAME.match(name):
        return name
    cleaned = re.sub(r"[^A-Za-z0-9_.:/-]", "_", name)
    if not re.match(r"[A-Za-z_]", cleaned):
        cleaned = "_" + cleaned
    return cleaned[:128]


NAME_PATTERN = r"^[^\s/\x00-\x1f\x7f]+$"
"""Project and run names: no whitespace, slash or control characters."""

MAX_LAYERS = 4096
"""Most layers a run may have (``config.n_layers``, a report's per-layer lists, override keys)."""
MAX_HEADS = 4096
"""Most heads per layer in a report."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of free-form JSON (a run's config, an event's data): a flat object is 1."""
MAX_CONFIG_BYTES = 256 * 1024
"""Largest run config, as compact JSON."""
MAX_EVENT_DATA_BYTES = 64 * 1024
"""Largest ``data`` of one event, as compact JSON."""
TAG_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:/=-]{0,63}$"
"""A run's tag: 1-64 ASCII letters, digits and ``_.:/=-``, starting with a letter, digit or ``_``
(``baseline``, ``lr=3e-4``, ``sweep/a``): no space or comma, so a tag is one word on a command line,
in ``QKWATCH_TAGS=a,b`` and in a query string."""
MAX_TAG_LENGTH = 64
MAX_TAGS = 50
"""Most tags one run may have."""
MAX_NOTES_BYTES = 10 * 1024
"""Longest notes of a run, in UTF-8 bytes."""
_TAG = re.compile(TAG_PATTERN)
_NOT_IN_NOTES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def decode_value(value: float | int | str | None) -> float | None:
    """Wire value (a JSON number may arrive as an int) -> float (non-finite allowed) or None ("not measured")."""
    if value is None or isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return _DECODE[value]
        except KeyError:
            raise ValueError(f"value {value!r} is neither a number nor one of 'nan', 'inf', '-inf'") from None
    if isinstance(value, bool):
        raise ValueError("a boolean is not a value")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"value {_brief(value)} is too large for a float") from None


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


def json_depth(value: Any, stop: int | None = None) -> int:
    """Nesting depth of a JSON value: 0 for a scalar, 1 for a flat object or array.

    Breadth-first, without recursion; counting ends past ``stop`` (the answer is then ``stop + 1``).
    """
    depth, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers or (stop is not None and depth > stop):
            return depth
        depth += 1
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]


def clip_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``value`` with every object or array deeper than ``max_depth`` replaced by a string saying so.

    For reading back JSON stored before its depth was bounded: a response serialiser refuses
    very deep values, and the stored value itself is kept as it is.
    """
    if json_depth(value, stop=max_depth) <= max_depth:
        return value

    def clip(v: Any, depth: int) -> Any:
        if not isinstance(v, (dict, list)):
            return v
        if depth >= max_depth:
            return f"<nested deeper than {max_depth} levels: not shown>"
        if isinstance(v, dict):
            return {k: clip(item, depth + 1) for k, item in v.items()}
        return [clip(item, depth + 1) for item in v]

    return clip(value, 0)


def _bounded_json(max_bytes: int) -> Callable[[Any], Any]:
    """A check of free-form JSON: at most ``MAX_JSON_DEPTH`` deep and ``max_bytes`` as compact JSON.

    Only an object or array is measured: anything else is left to the field's own validation.
    """

    def check(value: Any) -> Any:
        if not isinstance(value, (dict, list)):
            return value
        if json_depth(value, stop=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels (objects and arrays)")
        where = _non_finite(value)
        if where is not None:  # a literal such as 1e400 parses as inf, which JSON cannot carry back
            raise ValueError(f"{where} is a number beyond the range of a double (about 1.8e308)")
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        if size > max_bytes:
            raise ValueError(f"{size} bytes as JSON; the limit is {max_bytes}")
        return value

    return check


def _non_finite(value: Any, path: str = "") -> str | None:
    """The path (``a.b[2]``) of the first float in ``value`` that is not finite; None when there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path or "the value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, _child(path, key))
        if found is not None:
            return found
    return None


def _child(path: str, key: str | int) -> str:
    """The path of ``key`` below ``path``: ``a.b`` for an object's key, ``a[2]`` for an array's index."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_tag(tag: str) -> str:
    """``tag`` when it is a valid tag (:data:`TAG_PATTERN`); ValueError saying what a tag may hold."""
    if not _TAG.match(tag):
        raise ValueError(
            f"tag {_brief(tag)} must be 1-{MAX_TAG_LENGTH} characters of letters, digits and _.:/=- "
            "(ASCII, no space or comma), starting with a letter, digit or _"
        )
    return tag


def tag_set(tags: Any) -> list[str]:
    """Valid tags, each once, sorted: a list (or tuple) of at most :data:`MAX_TAGS` tags; ValueError otherwise."""
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise ValueError(f"tags must be a list of tags, got {_brief(tags)}")
    if len(tags) > MAX_TAGS:
        raise ValueError(f"{len(tags)} tags; a run has at most {MAX_TAGS}")
    for tag in tags:
        if not isinstance(tag, str):
            raise ValueError(f"a tag is a string, got {_brief(tag)}")
        check_tag(tag)
    return sorted(set(tags))


def check_notes(notes: str) -> str:
    """``notes`` when they fit: at most :data:`MAX_NOTES_BYTES` bytes as UTF-8, and no control
    character but tab, newline and carriage return (PostgreSQL cannot store NUL); ValueError otherwise."""
    size = len(notes.encode("utf-8", errors="surrogatepass"))
    if size > MAX_NOTES_BYTES:
        raise ValueError(f"notes are {size} bytes as UTF-8; the limit is {MAX_NOTES_BYTES}")
    bad = _NOT_IN_NOTES.search(notes)
    if bad:
        raise ValueError(f"notes may not hold the control character {bad.group()!r} (tab and newlines are fine)")
    try:
        notes.encode()
    except UnicodeEncodeError:
        raise ValueError("notes must be valid Unicode text (a lone surrogate is not)") from None
    return notes


def _as_set(tags: list[str]) -> list[str]:
    return sorted(set(tags))


def _brief(value: Any) -> str:
    """``repr`` for an error message, short: a huge int (whose repr may even be refused) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _schedule(value: Any) -> ScheduleConfig:
    """``config.schedule`` (an object of parameters, or null for the defaults) as the typed schedule."""
    if isinstance(value, ScheduleConfig):
        return value
    try:
        return ScheduleConfig.from_mapping(value)
    except ValueError as exc:  # it names the key: schedule.<key>
        raise ValueError(f"config.{exc}") from None


def _schedule_dict(schedule: ScheduleConfig) -> dict[str, Any]:
    return dataclasses.asdict(schedule)


def _layer_count(value: Any) -> Any:
    """``config.n_layers``: a whole number of layers, or null (unknown); anything else named and refused."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LAYERS):
        return value
    raise ValueError(f"config.n_layers must be a whole number of layers in [1, {MAX_LAYERS}], got {_brief(value)}")


Schedule = Annotated[
    ScheduleConfig,
    PlainValidator(_schedule),
    PlainSerializer(_schedule_dict),
    WithJsonSchema({**TypeAdapter(ScheduleConfig).json_schema(), "additionalProperties": False}),
]
"""A run's schedule on the wire: :meth:`ScheduleConfig.from_mapping` is its one parser; it is
written back with every parameter (``lambda_max`` resolved), so a stored run says what it ran with."""
LayerCount = Annotated[Annotated[int, Strict(), Field(ge=1, le=MAX_LAYERS)] | None, BeforeValidator(_layer_count)]
EventData = Annotated[dict[str, Any], AfterValidator(_bounded_json(MAX_EVENT_DATA_BYTES))]
Tag = Annotated[
    str,
    Strict(),
    AfterValidator(check_tag),
    WithJsonSchema({"type": "string", "pattern": TAG_PATTERN, "minLength": 1, "maxLength": MAX_TAG_LENGTH}),
]
"""One tag (:data:`TAG_PATTERN`); a bad one is refused with a message saying what a tag may hold."""
Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS), AfterValidator(_as_set)]
"""At most :data:`MAX_TAGS` tags, read as a set: each kept once, sorted."""
Notes = Annotated[
    str,
    Strict(),
    AfterValidator(check_notes),
    WithJsonSchema({"type": "string", "maxLength": MAX_NOTES_BYTES}),
]
"""Free text (Markdown is kept as it is), at most :data:`MAX_NOTES_BYTES` bytes as UTF-8."""
LayerValues = Annotated[list[WireValue], Field(max_length=MAX_LAYERS)]
HeadValues = Annotated[
    list[Annotated[list[WireValue], Field(max_length=MAX_HEADS)] | None], Field(max_length=MAX_LAYERS)
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Event(_Wire):
    """Something the agent wants on the record at a step (e.g. kind "missing_layers")."""

    kind: MetricName
    message: str = Field(default="", max_length=4096)
    data: EventData = Field(default_factory=dict)


class Report(_Wire):
    """One step of one run: per-layer values, optional per-head values, run-level scalars, events."""

    step: Annotated[int, Strict()] = Field(ge=0, le=2**62)
    time: Number = Field(description="Unix seconds when the step was measured.")
    layers: dict[MetricName, LayerValues] = Field(default_factory=dict)
    heads: dict[MetricName, HeadValues] = Field(default_factory=dict)
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


class RunConfig(BaseModel):
    """A run's config: the keys the collector acts on, typed and validated once, here; any other key
    (the recipe, hyperparameters) free-form, kept and served as it was sent.

    The API validates it on ``POST /v1/runs``; the store parses a stored one again when it loads
    the run row (see :func:`qkwatch.monitor.store.runs.load_config`), and the agent builds its local
    schedule from one, so every consumer reads ``config.schedule`` and ``config.n_layers``.
    """

    model_config = ConfigDict(extra="allow", frozen=True, use_attribute_docstrings=True)

    schedule: Schedule = Field(default_factory=ScheduleConfig)
    """The entropy-floor schedule's parameters; missing ones (or the whole object) take the defaults."""
    n_layers: LayerCount = None
    """The model's layer count (it sizes the lambdas); null: unknown. A resume may not change it."""

    def as_dict(self) -> dict[str, Any]:
        """The keys that were given, as JSON-ready Python values: what the collector stores and serves."""
        return self.model_dump(exclude_unset=True)


class RunCreate(_Wire):
    """``POST /v1/runs``: create, or resume (same project and name), a run."""

    project: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    name: str = Field(min_length=1, max_length=200, pattern=NAME_PATTERN)
    config: Annotated[RunConfig, BeforeValidator(_bounded_json(MAX_CONFIG_BYTES))] = Field(default_factory=RunConfig)
    attempt_key: str | None = Field(default=None, min_length=1, max_length=200)
    tags: Tags = Field(
        default_factory=list,
        description="Added to the run's tags (a resume never removes one; PATCH does); "
        f"beyond {MAX_TAGS} on a resume, the rest are left out.",
    )
    notes: Notes | None = Field(
        default=None,
        description="The run's notes when it has none yet; a resume keeps notes already set (PATCH changes them).",
    )


RunStatus = Literal["running", "finished", "crashed"]


STATUS_REASON_MAX = 200
"""Longest status reason the collector stores (the agent truncates longer ones)."""


class RunPatch(_Wire):
    """``PATCH /v1/runs/{id}``: how the run ended, and its tags and notes; give any of them.

    ``{"status": "crashed", "reason": "RuntimeError: ..."}`` is what the agent sends after the run's last
    report; it is idempotent, so a replay (``qkwatch sync``) is harmless. ``attempt`` names the attempt
    that ended: a status of an attempt older than the run's latest (a resumed run's earlier process,
    delivered late) is ignored, so it cannot mark the running attempt crashed.

    ``{"tags": [...]}`` replaces the run's tags (``[]`` removes them all), ``add_tags`` and
    ``remove_tags`` change only those named, and ``notes`` replaces the notes (``""`` or null clears
    them). All of it is applied in one transaction, or nothing is.
    """

    status: RunStatus | None = None
    reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=STATUS_REASON_MAX,
        description="Stored as status_reason (default: patch); only with a status.",
    )
    attempt: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Default: the run's latest attempt; only with a status."
    )
    tags: Tags | None = Field(default=None, description="The run's tags from now on ([]: none).")
    add_tags: Tags | None = Field(default=None, description="Tags to add (those the run has are kept).")
    remove_tags: Tags | None = Field(default=None, description="Tags to remove (one the run lacks is fine).")
    notes: Notes | None = Field(default=None, description='The notes from now on ("" or null: none).')

    @model_validator(mode="after")
    def _coherent(self) -> RunPatch:
        if self.status is None and (self.reason is not None or self.attempt is not None):
            raise ValueError("reason and attempt go with a status")
        if self.status is None and not self.annotates():
            raise ValueError("nothing to change: give status, tags, add_tags, remove_tags or notes")
        if self.tags is not None and (self.add_tags is not None or self.remove_tags is not None):
            raise ValueError("tags replaces the run's tags: give it alone, or add_tags and remove_tags")
        both = set(self.add_tags or ()) & set(self.remove_tags or ())
        if both:
            raise ValueError(f"tag {sorted(both)[0]!r} is in both add_tags and remove_tags")
        return self

    def annotates(self) -> bool:
        """Whether it changes tags or notes (``"notes": null`` clears them, so it counts)."""
        return (
            any(x is not None for x in (self.tags, self.add_tags, self.remove_tags)) or "notes" in self.model_fields_set
        )


class OverridesPut(RootModel[dict[str, Number | None]]):
    """``PUT /v1/runs/{id}/lambdas/overrides``: ``{"3": 0.0, "12": 0.5}``; null removes an override.

    Keys are layer indices as strings of plain ASCII decimal digits without leading zeros
    (:func:`layer_key`). The server checks each value against the run's ``lambda_max``
    (finite, 0 <= value <= lambda_max) and the index against the layer count.
    """


def layer_key(key: str) -> int:
    """A layer index written as a JSON object key: ``"0"``, ``"12"``; ValueError for anything else.

    Only the canonical spelling: no sign, spaces, underscores, leading zeros or non-ASCII digits
    (all of which ``int()`` accepts), and below :data:`MAX_LAYERS`.
    """
    if not re.fullmatch(r"0|[1-9][0-9]{0,5}", key) or int(key) >= MAX_LAYERS:
        raise ValueError(f"key {key!r} is not a layer index (a decimal number from 0 to {MAX_LAYERS - 1})")
    return int(key)
