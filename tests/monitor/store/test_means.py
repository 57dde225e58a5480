"""Bucket means (``qkwatch/monitor/store/values/means.py``) against exact answers: finite for huge finite values,
IEEE for infinities, and the plain mean for values of ordinary size."""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest

from qkwatch.monitor.store.values.means import SCALE, mean, of_aggregates

MAX = sys.float_info.max
TINY = 5e-324


def exact_mean(values: list[float]) -> float:
    """The mean in exact rational arithmetic, rounded once."""
    return float(sum(map(Fraction, values)) / len(values))


@pytest.mark.parametrize(
    "values",
    [
        [1.7e308] * 2000,
        [MAX] * 3,
        [MAX, -MAX],
        [MAX, MAX, -MAX],
        [TINY, MAX],
        [1e200, 3e200] * 500,
        [-1.7e308, -1.6e308, 0.5, 1e-300],
    ],
)
def test_the_mean_of_huge_finite_values_is_finite_and_close(values):
    got = mean(values)
    assert math.isfinite(got) and min(values) <= got <= max(values)
    assert got == pytest.approx(exact_mean(values), rel=1e-12, abs=1e-300)


def test_ordinary_values_get_the_plain_mean():
    values = [0.1, 0.2, 0.3, 7.0, -2.5]
    assert mean(values) == sum(values) / len(values)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([math.inf, 1.0], math.inf), ([-math.inf, MAX, MAX], -math.inf), ([math.inf, -math.inf, 2.0], math.nan)],
)
def test_infinities_keep_their_ieee_meaning(values, expected):
    got = mean(values)
    assert got == expected or (math.isnan(expected) and math.isnan(got))


def test_of_aggregates_is_nan_for_a_bucket_with_no_value():
    assert math.isnan(of_aggregates(None, None, None, None, 0))


def test_of_aggregates_clamps_rounding_at_the_top_of_the_range():
    n = 3
    big = (MAX * SCALE) * n * (1 + 2**-52)  # a scaled sum that rounded up by one unit
    assert of_aggregates(big, None, MAX, MAX, n) == MAX
