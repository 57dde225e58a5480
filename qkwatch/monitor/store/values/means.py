"""Bucket means that stay finite: huge finite values (1.7e308) average to a finite number, the same
on SQLite and PostgreSQL, in SQL and in Python.

A plain mean overflows: the sum of two values near the float64 maximum (about 1.8e308) is past it,
so SQLite's ``avg`` answers ``inf`` and Python's ``sum(c) / len(c)`` too. PostgreSQL's
``avg(double precision)`` is worse: it keeps a sum of squares beside the sum and raises "value out
of range: overflow" as soon as the values spread by more than about 1e154, which a GET answered as
a 422. Here a mean is made from two sums that can neither overflow nor underflow::

    big   = sum(x * 2**-64 for |x| >= 1)    # each term is below 2**960: 2**64 terms cannot overflow
    small = sum(x for |x| < 1)              # each term is below 1
    mean  = (big / n) * 2**64 + small / n   # then clamped to [min, max]

Scaling by a power of two is exact when no term underflows, which ``|x| >= 1`` guarantees
(PostgreSQL raises on an underflow too), so values of ordinary size sum as they did with ``avg``.
The true mean lies in [min, max]; the clamp only takes back rounding, such as ``(big / n) * 2**64``
rounding past the float64 maximum when every value is that maximum. Infinities keep IEEE meaning: a
bucket holding +inf (or -inf) among finite values has that infinity as its mean, one holding both
has NaN. Values are never NaN here: a stored NaN is NULL, which the sums skip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

SCALE = 2.0**-64
"""What the terms of magnitude 1 and above are multiplied by before they are summed."""


def aggregates(value: sa.ColumnElement[float]) -> list[sa.ColumnElement[Any]]:
    """The SQL aggregates of a bucket that :func:`of_aggregates` turns into its mean, in its order:
    the scaled sum of the large values, the sum of the small ones, min, max and the count of non-NULL."""
    large = sa.func.abs(value) >= 1.0
    return [
        sa.func.sum(sa.case((large, value * sa.literal(SCALE, sa.Double)))),
        sa.func.sum(sa.case((sa.func.abs(value) < 1.0, value))),
        sa.func.min(value),
        sa.func.max(value),
        sa.func.count(value),
    ]


def of_aggregates(big: float | None, small: float | None, lo: float | None, hi: float | None, n: int) -> float:
    """The mean of a bucket from its :func:`aggregates`; NaN when it has no value (every member NaN)."""
    if not n or lo is None or hi is None:
        return math.nan
    if math.isinf(lo) or math.isinf(hi):
        return math.nan if (lo, hi) == (-math.inf, math.inf) else (hi if math.isinf(hi) else lo)
    total = (big or 0.0) / n / SCALE + (small or 0.0) / n
    return min(max(total, lo), hi)


def mean(values: Sequence[float]) -> float:
    """The mean of ``values`` (at least one, none NaN), finite whenever they all are.

    The plain ``sum / n`` when its sum is finite (the usual case, and as fast as before); else the
    same two sums as :func:`aggregates`.
    """
    total = sum(values)
    if math.isfinite(total):
        return total / len(values)
    return of_values(values)


def of_values(values: Sequence[float]) -> float:
    """The mean of ``values`` (at least one, none NaN) as :func:`aggregates` computes it in SQL: the
    two sums, in the order given. A huge value and its negative cancel exactly here, where the plain
    sum of :func:`mean` can lose the small values beside them."""
    big = sum(v * SCALE for v in values if abs(v) >= 1.0)
    small = sum(v for v in values if abs(v) < 1.0)
    return of_aggregates(big, small, min(values), max(values), len(values))
