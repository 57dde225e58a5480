"""A value on the wire, and the names, tags and notes that travel with it (stdlib and pydantic only).

Values: a JSON number, or one of the strings ``"nan"``, ``"inf"``, ``"-inf"``; ``null`` means
"not measured" and is never stored. In Python a value is a ``float`` (possibly non-finite) or
``None``: :func:`decode_value` and :func:`encode_value` convert between the two. Metric names, tags
and notes each have one pattern or bound here, which the agent cleans to and the collector checks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, Strict

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
        raise ValueError(f"value {brief(value)} is too large for a float") from None


def encode_value(value: float | None) -> float | str | None:
    """Float (or None) -> strict-JSON wire value: non-finite floats become "nan", "inf", "-inf"."""
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def encode_nested(value: Any) -> Any:
    if isinstance(value, float):
        return encode_value(value)
    if isinstance(value, list):
        return [encode_nested(v) for v in value]
    if isinstance(value, dict):
        return {k: encode_nested(v) for k, v in value.items()}
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


def bounded_json(max_bytes: int) -> Callable[[Any], Any]:
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
            f"tag {brief(tag)} must be 1-{MAX_TAG_LENGTH} characters of letters, digits and _.:/=- "
            "(ASCII, no space or comma), starting with a letter, digit or _"
        )
    return tag


def tag_set(tags: Any) -> list[str]:
    """Valid tags, each once, sorted: a list (or tuple) of at most :data:`MAX_TAGS` tags; ValueError otherwise."""
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise ValueError(f"tags must be a list of tags, got {brief(tags)}")
    if len(tags) > MAX_TAGS:
        raise ValueError(f"{len(tags)} tags; a run has at most {MAX_TAGS}")
    for tag in tags:
        if not isinstance(tag, str):
            raise ValueError(f"a tag is a string, got {brief(tag)}")
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


def as_set(tags: list[str]) -> list[str]:
    return sorted(set(tags))


def brief(value: Any) -> str:
    """``repr`` for an error message, short: a huge int (whose repr may even be refused) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
