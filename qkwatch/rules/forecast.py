"""A forecast rule's line: the trend of a layer's recent points, and the step at which it crosses.

Pure maths, apart from the rule that asks for it (:class:`~qkwatch.rules.kinds.ForecastRule`
says which line, which threshold and how many points) and from the streak that decides whether a
crossing fires (:func:`qkwatch.rules.transitions.evaluate`), so that the fit can be
checked against closed forms on its own.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from qkwatch.rules.kinds import ForecastRule


@dataclass(frozen=True)
class Forecast:
    """The line through a layer's recent points: its slope and where it crosses the threshold."""

    slope: float
    """Change of the metric per step."""
    crossing: float
    """The step at which the line crosses the rule's threshold."""


_FIT_SCALE_ABOVE = 2.0**500
"""A forecast's window with a value this large is fitted in scaled units (:func:`fit_line`)."""


def fit_line(rule: ForecastRule, points: list[tuple[int, float]]) -> Forecast | None:
    """The line through ``points`` ((step, value), at least ``window`` of them), None when it heads away.

    ``least_squares``: slope = sum (x - x0)(y - y0) / sum (x - x0)^2 about the means (x0, y0),
    through (x0, y0). ``theil_sen``: the median of the slopes of every pair of points, through
    the point (x0, median of y - slope (x - x0)); one outlying report (a jump) moves it little.
    The line reaches a target t at step x0 + (t - y0) / slope, where t is the threshold moved
    toward the values by ``margin`` times the residuals' standard deviation,
    sqrt(sum r^2 / max(n - 2, 1)).
    """
    n = len(points)
    if n < rule.window:
        return None
    # Values near the top of the double range (a logit_max of 1e308) would overflow the sums:
    # the crossing step does not change when values and threshold are scaled together, so such
    # a window is fitted in units of a power of two that brings them under 1.
    top = max(abs(rule.threshold), *(abs(y) for _, y in points))
    scale = math.ldexp(1.0, math.frexp(top)[1]) if top > _FIT_SCALE_ABOVE else 1.0
    xs = [float(x) for x, _ in points]
    ys = [y / scale for _, y in points]
    x0 = math.fsum(xs) / n
    if rule.fit == "theil_sen":
        slope = statistics.median(
            [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
        )
        y0 = statistics.median([y - slope * (x - x0) for x, y in zip(xs, ys, strict=True)])
    else:
        y0 = math.fsum(ys) / n
        slope = math.fsum((x - x0) * (y - y0) for x, y in zip(xs, ys, strict=True)) / math.fsum(
            (x - x0) ** 2 for x in xs
        )
    if not (slope > 0 if rule.rising else slope < 0):
        return None
    target = rule.threshold / scale
    if rule.margin:
        spread = math.sqrt(
            math.fsum((y - y0 - slope * (x - x0)) ** 2 for x, y in zip(xs, ys, strict=True)) / max(n - 2, 1)
        )
        target += -rule.margin * spread if rule.rising else rule.margin * spread
    return Forecast(slope * scale, x0 + (target - y0) / slope)
