"""The wire schema between the agent and the collector (pydantic and the standard library only).

The models of what the agent sends: a run (:class:`RunCreate`, its typed :class:`RunConfig`), a
batch of reports (:class:`ReportBatch` of :class:`Report`, with :class:`Event`), a run's end
(:class:`RunPatch`) and an operator's lambda overrides (:class:`OverridesPut`). Values and names
follow :mod:`qkwatch.contract.values`; the models serialise non-finite floats as ``"nan"``,
``"inf"``, ``"-inf"``, so ``model_dump(mode="json")`` is strict JSON. The answers are the ``*Public``
models of :mod:`qkwatch.contract.responses`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import uuid
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

from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.contract.values import (
    MAX_CONFIG_BYTES,
    MAX_EVENT_DATA_BYTES,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_NOTES_BYTES,
    MAX_TAG_LENGTH,
    MAX_TAGS,
    NAME_PATTERN,
    TAG_PATTERN,
    MetricName,
    Number,
    WireValue,
    as_set,
    bounded_json,
    brief,
    check_notes,
    check_tag,
    encode_nested,
)


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
    raise ValueError(f"config.n_layers must be a whole number of layers in [1, {MAX_LAYERS}], got {brief(value)}")


Schedule = Annotated[
    ScheduleConfig,
    PlainValidator(_schedule),
    PlainSerializer(_schedule_dict),
    WithJsonSchema({**TypeAdapter(ScheduleConfig).json_schema(), "additionalProperties": False}),
]
"""A run's schedule on the wire: :meth:`ScheduleConfig.from_mapping` is its one parser; it is
written back with every parameter (``lambda_max`` resolved), so a stored run says what it ran with."""
LayerCount = Annotated[Annotated[int, Strict(), Field(ge=1, le=MAX_LAYERS)] | None, BeforeValidator(_layer_count)]
EventData = Annotated[dict[str, Any], AfterValidator(bounded_json(MAX_EVENT_DATA_BYTES))]
Tag = Annotated[
    str,
    Strict(),
    AfterValidator(check_tag),
    WithJsonSchema({"type": "string", "pattern": TAG_PATTERN, "minLength": 1, "maxLength": MAX_TAG_LENGTH}),
]
"""One tag (:data:`TAG_PATTERN`); a bad one is refused with a message saying what a tag may hold."""
Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS), AfterValidator(as_set)]
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
        return encode_nested(value)

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
    the run row (see :func:`qkwatch.monitor.store.runs.lookup.load_config`), and the agent builds its local
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
    config: Annotated[RunConfig, BeforeValidator(bounded_json(MAX_CONFIG_BYTES))] = Field(default_factory=RunConfig)
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
