"""How an answer of the collector's API reads: the base of every answer, a page, a value, a time.

:mod:`qkwatch.contract.responses` declares the answers on these. An :class:`Answer` is frozen and
readable as its JSON (``answer["key"]``, ``dict(answer)``); one the client parsed with
:meth:`Answer.of` keeps the JSON as the collector sent it. A :class:`Value` is a float in Python and
a wire value in JSON. A time travels as epoch seconds; :func:`utc` reads it as an aware datetime.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView
from datetime import datetime, timezone
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ModelWrapValidatorHandler,
    PlainSerializer,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from qkwatch.contract.values import decode_value, encode_value

A = TypeVar("A", bound="Answer")
T = TypeVar("T", bound="Answer")

Value = Annotated[
    float | None,
    BeforeValidator(decode_value),
    PlainSerializer(encode_value, when_used="json"),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "string"}, {"type": "null"}]}),
]
"""A measured value: a float here (NaN and infinities included), a wire value in JSON; None: not measured."""

_AS_SENT = "as_sent"
"""The validation context key that keeps each answer's JSON (see :meth:`Answer.of`)."""


def utc(seconds: float | None) -> datetime | None:
    """Epoch seconds -> an aware UTC datetime; None for None, or for a time no calendar date holds
    (an event's ``time`` is the trainer's clock)."""
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


def iso(seconds: float | None) -> str | None:
    """Epoch seconds -> ISO 8601 in UTC with milliseconds (``2026-01-02T03:04:05.678+00:00``); None
    where :func:`utc` is None."""
    when = utc(seconds)
    return None if when is None else when.isoformat(timespec="milliseconds")


def collector_time(seconds: float) -> datetime:
    """A time of the collector's own clock (always a calendar date) as an aware UTC datetime."""
    return datetime.fromtimestamp(seconds, timezone.utc)


class Answer(BaseModel):
    """Base of every answer: frozen, and readable as its JSON (``answer["key"]``, ``dict(answer)``)."""

    model_config = ConfigDict(frozen=True)

    _raw: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_as_sent(cls, data: Any, handler: ModelWrapValidatorHandler[Any], info: ValidationInfo) -> Any:
        answer = handler(data)
        if isinstance(info.context, dict) and info.context.get(_AS_SENT) and isinstance(data, dict):
            answer._raw = data  # nested answers (a page's items) keep their own part of the JSON
        return answer

    @classmethod
    def of(cls: type[A], raw: dict[str, Any]) -> A:
        """The answer of the JSON ``raw`` (as the collector sent it), which :attr:`raw` keeps.

        Raises:
            pydantic.ValidationError: ``raw`` is not this answer.
        """
        answer: A = cls.model_validate(raw, context={_AS_SENT: True})
        return answer

    @property
    def raw(self) -> dict[str, Any]:
        """The JSON: as sent, for an answer parsed by :meth:`of`; else as it would be sent."""
        if self._raw is None:
            self._raw = self.model_dump(mode="json", by_alias=True)
        return self._raw

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def keys(self) -> KeysView[str]:
        return self.raw.keys()

    def __eq__(self, other: object) -> bool:
        """Equal to an answer of the same kind, or to a dict, holding the same JSON (NaN equals NaN there)."""
        if isinstance(other, dict):
            return self.raw == other
        return isinstance(other, Answer) and type(other) is type(self) and self.raw == other.raw


class Page(Answer, Generic[T]):
    """A list answer: ``data`` (this page) and ``count`` (all matches); iterating gives ``data``."""

    data: list[T]
    count: int

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]  # a page iterates its items, not its fields
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | str) -> Any:
        """``page[0]``: the first item; ``page["data"]``: the JSON."""
        return self.raw[key] if isinstance(key, str) else self.data[key]
