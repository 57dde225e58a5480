"""The alert rules' kinds: what each rule says and which values it takes (pure; no evaluation, no I/O).

Persistence is counted in *reports*, not wall-clock time (Prometheus ``for:`` counts seconds,
which mean nothing to a run that may pause for a checkpoint). Four kinds of rule:

* **threshold**: fires on a layer once ``metric op threshold`` held for ``for_reports``
  consecutive reports of that layer, and resolves at the first report where it no longer holds.
  ``op`` is one of ``> >= < <=``: ``qkai > 0.70`` (collapse), ``stable_rank < 1.2`` (the rank of
  W_Q W_K^T falling), ``attn_entropy > 0.98`` (uniform attention) or ``attn_entropy < 0.05``
  (one-hot attention).
* **band**: fires while at least ``min_layers`` adjacent layers fire a threshold rule
  (``band_of``; the collapse band of seed 000).
* **growth**: a layer's ``metric`` relative to the run's own early value of that layer (the
  attention-logit-growth sign of Wortsman et al. 2023, arXiv 2309.14322, and Dehghani et al. 2023:
  ``logit_max`` grows many-fold before the loss diverges). The layer's first ``skip_reports``
  reports are passed over (e.g. the report at step 0, measured at initialisation); the mean of its
  next ``baseline_reports`` finite values is its baseline. After that, it fires once
  ``value / baseline >= factor`` held for ``for_reports`` consecutive reports (a ratio, not a
  difference: logits of different layers and models live on different scales). A ``factor`` below
  1 watches a fall instead: it fires once ``value / baseline <= factor`` (``stable_rank`` at half
  its early value: ``factor: 0.5``). A layer whose baseline is not positive is never judged.
  Summary: ``layer 4: logit_max 3.2x its early value (41 vs 12.8; ...)``.
* **forecast**: a line through the layer's last ``window`` finite (step, value) points of
  ``metric`` (``fit``: least squares, or Theil-Sen's median of pairwise slopes) predicts the step
  at which it crosses ``threshold`` in the direction of ``op`` (``>``/``>=``: rising through it;
  ``<``/``<=``: falling through it), or comes within ``margin`` residual standard deviations of it. It fires once, for
  ``for_reports`` consecutive reports, the slope points toward the threshold, the latest value is
  not past it yet (past it, the threshold rule speaks) and the predicted crossing is at most
  ``horizon_steps`` ahead. It resolves when the forecast stops saying so, or when the value
  crosses. The predicted crossing step is in the summary (``layer 3: qkai 0.58 rising
  0.0004/step, crosses 0.70 in about 300 steps (at step ~1450)``) and in
  ``Transition.predicted_step`` (:mod:`qkwatch.rules.transitions`; the alert's
  ``predicted_step``), so that a forecast can be scored against the step at which the value
  really crossed. It fires only once it holds ``window`` points.

This module holds what a rule *is*; :mod:`qkwatch.rules.transitions` judges reports
against it (:func:`~qkwatch.rules.transitions.evaluate`), with the forecast rule's line
fitted by :mod:`qkwatch.rules.forecast`, and :mod:`qkwatch.rules.ruleset`
reads the rules file into these classes.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import TypeGuard

from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
from qkwatch.contract.values import METRIC_NAME_PATTERN

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
SEVERITY_MAX = 32
"""Longest severity (the alerts table's column)."""
MEMORY_MAX = 256
"""Most values a growth rule's baseline or a forecast rule's window may hold per layer (the stored state)."""


MAX_FOR_REPORTS = 10_000
"""Most consecutive reports a rule may wait for (a bound, so a typo of a huge number is refused)."""


def _check_name(rule: str, key: str, value: object) -> None:
    """Rule and metric names: what a report's metric name may be (letters, digits, ``_.:/-``)."""
    if not isinstance(value, str) or not re.fullmatch(METRIC_NAME_PATTERN, value):
        raise ValueError(
            f"rule {brief_repr(rule)}: {key} must be a name of letters, digits and _.:/- "
            f"(starting with a letter or _), got {brief_repr(value)}"
        )


def _check_int(rule: str, key: str, value: object, low: int = 1, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"rule {brief_repr(rule)}: {key} must be a whole number {bound}, got {brief_repr(value)}")


def _check_number(rule: str, key: str, value: object, above: float | None = None) -> None:
    if not finite(value):
        raise ValueError(f"rule {brief_repr(rule)}: {key} must be a finite number, got {brief_repr(value)}")
    if above is not None and value <= above:
        raise ValueError(f"rule {brief_repr(rule)}: {key} must be above {above:g}, got {brief_repr(value)}")


def finite(value: object) -> TypeGuard[int | float]:
    """A finite int or float (not a bool); an int too large for a float is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # math.isfinite converts an int to a float first
        return False


def brief_repr(value: object) -> str:
    """``repr`` for an error message, short: a huge int (whose repr may even be refused) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _check_op(rule: str, value: object) -> None:
    if not isinstance(value, str) or value not in _OPS:
        raise ValueError(f"rule {brief_repr(rule)}: op must be one of {', '.join(_OPS)}, got {brief_repr(value)}")


def _check_severity(rule: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= SEVERITY_MAX or not value.isprintable():
        raise ValueError(
            f"rule {brief_repr(rule)}: severity must be a word of 1 to {SEVERITY_MAX} characters, "
            f"got {brief_repr(value)}"
        )


@dataclass(frozen=True)
class ThresholdRule:
    """Fires per layer when ``metric op threshold`` for ``for_reports`` consecutive reports."""

    name: str
    metric: str = "qkai"
    op: str = ">"
    threshold: float = COLLAPSE_THRESHOLD
    for_reports: int = 3
    severity: str = "warning"

    def __post_init__(self) -> None:
        _check_name(self.name, "name", self.name)
        _check_name(self.name, "metric", self.metric)
        _check_op(self.name, self.op)
        _check_number(self.name, "threshold", self.threshold)
        _check_int(self.name, "for_reports", self.for_reports, high=MAX_FOR_REPORTS)
        _check_severity(self.name, self.severity)

    def holds(self, value: float) -> bool:
        """NaN never satisfies a rule (it is not evidence of collapse)."""
        return not math.isnan(value) and _OPS[self.op](value, self.threshold)

    def describe(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g} for {self.for_reports} consecutive reports"


@dataclass(frozen=True)
class BandRule:
    """Fires while at least ``min_layers`` adjacent layers fire the threshold rule ``band_of``."""

    name: str
    band_of: str
    min_layers: int = 3
    severity: str = "critical"

    def __post_init__(self) -> None:
        _check_name(self.name, "name", self.name)
        _check_name(self.name, "band_of", self.band_of)
        _check_int(self.name, "min_layers", self.min_layers)
        _check_severity(self.name, self.severity)


@dataclass(frozen=True)
class GrowthRule:
    """Fires per layer when ``value / baseline >= factor`` (a rise; ``<= factor`` for a factor below 1,
    a fall) for ``for_reports`` consecutive reports.

    ``baseline``: the mean of the layer's first ``baseline_reports`` finite values after its first
    ``skip_reports`` reports; a layer is not judged before it has one, nor when it is not positive.
    """

    name: str
    factor: float
    metric: str = "logit_max"
    baseline_reports: int = 5
    skip_reports: int = 0
    for_reports: int = 3
    severity: str = "warning"

    def __post_init__(self) -> None:
        _check_name(self.name, "name", self.name)
        _check_name(self.name, "metric", self.metric)
        _check_number(self.name, "factor", self.factor, above=0)
        if self.factor == 1:
            raise ValueError(
                f"rule {brief_repr(self.name)}: factor must be above 1 (a rise) or below 1 (a fall), got 1"
            )
        _check_int(self.name, "baseline_reports", self.baseline_reports, high=MEMORY_MAX)
        _check_int(self.name, "skip_reports", self.skip_reports, low=0)
        _check_int(self.name, "for_reports", self.for_reports, high=MAX_FOR_REPORTS)
        _check_severity(self.name, self.severity)

    @property
    def rising(self) -> bool:
        """A factor above 1 watches a rise, below 1 a fall."""
        return self.factor > 1

    def holds(self, ratio: float) -> bool:
        """``ratio`` (value / baseline) is at or past the factor, in the rule's direction."""
        return ratio >= self.factor if self.rising else ratio <= self.factor

    def describe(self) -> str:
        at = "" if self.rising else " or below"
        return f"fires at {self.factor:g}x{at} for {self.for_reports} consecutive reports"


@dataclass(frozen=True)
class Forecast:
    """A least-squares line through a layer's recent points: its slope and where it crosses the threshold."""

    slope: float
    """Change of the metric per step."""
    crossing: float
    """The step at which the line crosses the rule's threshold."""


@dataclass(frozen=True)
class ForecastRule:
    """Fires per layer when the trend of its last ``window`` points crosses ``threshold`` within ``horizon_steps``."""

    name: str
    horizon_steps: int
    metric: str = "qkai"
    op: str = ">"
    threshold: float = COLLAPSE_THRESHOLD
    window: int = 8
    for_reports: int = 1
    severity: str = "warning"
    fit: str = "least_squares"
    """The line through the window: ``least_squares`` or ``theil_sen`` (median of pairwise slopes)."""
    margin: float = 0.0
    """Predict where the line comes within ``margin`` residual standard deviations of the threshold:
    where a noisy value first gets across it, rather than where its trend does."""

    def __post_init__(self) -> None:
        _check_name(self.name, "name", self.name)
        _check_name(self.name, "metric", self.metric)
        _check_op(self.name, self.op)
        _check_number(self.name, "threshold", self.threshold)
        _check_int(self.name, "horizon_steps", self.horizon_steps)
        _check_int(self.name, "window", self.window, low=2, high=MEMORY_MAX)
        _check_int(self.name, "for_reports", self.for_reports, high=MAX_FOR_REPORTS)
        _check_severity(self.name, self.severity)
        if not isinstance(self.fit, str) or self.fit not in FITS:
            raise ValueError(
                f"rule {brief_repr(self.name)}: fit must be one of {', '.join(FITS)}, got {brief_repr(self.fit)}"
            )
        if self.fit == "theil_sen":
            _check_int(self.name, "window (theil_sen)", self.window, low=2, high=THEIL_SEN_WINDOW_MAX)
        _check_number(self.name, "margin", self.margin)
        if self.margin < 0:
            raise ValueError(f"rule {brief_repr(self.name)}: margin must be 0 or more, got {self.margin!r}")

    @property
    def rising(self) -> bool:
        return self.op in (">", ">=")

    def past(self, value: float) -> bool:
        """The value is already across the threshold (``inf`` is past ``>``; NaN is past nothing)."""
        return not math.isnan(value) and _OPS[self.op](value, self.threshold)


FITS = ("least_squares", "theil_sen")
"""A forecast rule's lines (ForecastRule.fit)."""
THEIL_SEN_WINDOW_MAX = 64
"""Largest window of a theil_sen forecast: each layer's report takes the median of window (window - 1) / 2 slopes."""

LayerRule = ThresholdRule | GrowthRule | ForecastRule
"""A rule judged layer by layer (a band looks at the layers of a threshold rule)."""
Rule = ThresholdRule | BandRule | GrowthRule | ForecastRule
