"""Frames: all layer values of one (report, metric) as one float64 array, and the heatmap built from them.

A heatmap of a 48-layer run reads one frame per step instead of 48 point rows, and reduces the
buckets with C-level ``map`` over whole rows: this is what keeps it fast (see bench/RESULTS.md).
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qkwatch.monitor.store.values import means

FrameRow = tuple[str, int, str, bytes, bytes | None, bool]
"""(metric, step, mask, vals, present, has_nan) as stored (run and attempt are added on insert)."""


def pack(metric: str, step: int, values: Sequence[float | None]) -> FrameRow | None:
    """A frame of decoded layer values (None = not measured); None when no layer was measured."""
    present = bytes(v is not None for v in values)
    if not any(present):
        return None
    vals = array("d", (math.nan if v is None else v for v in values)).tobytes()
    has_nan = any(v is not None and math.isnan(v) for v in values)
    if all(present):
        return metric, step, f"a{len(values)}", vals, None, has_nan
    return metric, step, hashlib.sha1(present).hexdigest()[:16], vals, present, has_nan


@dataclass(frozen=True)
class MergedStep:
    """One step's layer values, its frames merged (:func:`merge_steps`); None: not measured."""

    step: int
    values: Sequence[float | None]
    clean: bool
    """Every layer present and finite-or-inf (no NaN): eligible for the C-level reduction."""


def merge_steps(rows: Iterable[tuple[int, bytes, bytes | None, bool]]) -> list[MergedStep]:
    """Rows (step, vals, present, has_nan) ordered by (step, attempt) -> one value list per step.

    Within a step, a later row overwrites the layers it carries: the latest attempt wins, and
    frames of one attempt carrying different layers (ranks) combine.
    """
    out: list[MergedStep] = []
    for step, vals, present, has_nan in rows:
        a = array("d")
        a.frombytes(vals)
        if out and out[-1].step == step:
            cur = list(out[-1].values)
            cur += [None] * (len(a) - len(cur))
            for i, v in enumerate(a):
                if present is None or present[i]:
                    cur[i] = v
            out[-1] = MergedStep(step, cur, False)
        elif present is None:
            out.append(MergedStep(step, a.tolist(), not has_nan))
        else:
            out.append(MergedStep(step, [v if p else None for v, p in zip(a, present, strict=True)], False))
    return out


_DOUBLE = struct.Struct("d")


def column(rows: Iterable[tuple[int, bytes | None, bytes | None]]) -> tuple[list[int], list[float]]:
    """One layer out of frames: rows (step, the layer's 8 bytes of ``vals``, its byte of ``present``)
    ordered by (step, attempt) -> (steps, values), the merged value per step where the layer was measured.

    The layer's bytes are empty (or None) in a frame too short to hold it; its ``present`` byte is None
    when the frame holds every layer. A later row of a step that carries the layer overwrites the value,
    as in :func:`merge_steps`.
    """
    steps: list[int] = []
    values: list[float] = []
    for step, v8, p1 in rows:
        if not v8 or len(v8) != 8 or (p1 is not None and p1 != b"\x01"):
            continue
        value = _DOUBLE.unpack(v8)[0]
        if steps and steps[-1] == step:
            values[-1] = value
        else:
            steps.append(step)
            values.append(value)
    return steps, values


def heatmap(
    steps: list[MergedStep], max_steps: int, agg: str
) -> tuple[list[int], list[int], list[list[float | None]], bool]:
    """Bucket ``steps`` to at most ``max_steps`` columns; returns (steps, layers, values, downsampled).

    A bucket's step is its first step; its value per layer is the ``agg`` ("max", "min", "mean")
    of the layer's non-NaN values, NaN when all were NaN, None when the layer was not measured.
    """
    if not steps:
        return [], [], [], False
    lo, hi = steps[0].step, steps[-1].step
    width = max(1, -(-(hi - lo + 1) // max_steps))
    n = max(len(s.values) for s in steps)
    buckets: list[list[MergedStep]] = []
    last = None
    for s in steps:
        b = (s.step - lo) // width
        if b != last:
            buckets.append([])
            last = b
        buckets[-1].append(s)
    rows = [_reduce(group, n, agg) for group in buckets]
    layers = [i for i in range(n) if any(r[i] is not None for r in rows)]
    if len(layers) < n:
        rows = [[r[i] for i in layers] for r in rows]
    return [g[0].step for g in buckets], layers, rows, width > 1


def _reduce(group: list[MergedStep], n: int, agg: str) -> list[float | None]:
    vectors = [s.values for s in group]
    if all(s.clean and len(s.values) == n for s in group):
        if len(vectors) == 1:
            return list(vectors[0])
        if agg == "max":
            return list(map(max, *vectors))
        if agg == "min":
            return list(map(min, *vectors))
        return [means.mean(c) for c in zip(*vectors, strict=True)]
    return [_reduce_column([v[i] for v in vectors if i < len(v)], agg) for i in range(n)]


def _reduce_column(values: list[float | None], agg: str) -> float | None:
    measured = [v for v in values if v is not None]
    if not measured:
        return None
    real = [v for v in measured if not math.isnan(v)]
    if not real:
        return math.nan
    if agg == "max":
        return max(real)
    if agg == "min":
        return min(real)
    return means.mean(real)
