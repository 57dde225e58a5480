"""Alert rules, pure: rules + per-layer state + new reports -> transitions (no I/O).

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
  difference: logits of different layers and models live on different scales). A layer whose
  baseline is not positive is never judged. Summary: ``layer 4: logit_max 3.2x its early value
  (41 vs 12.8; ...)``.
* **forecast**: a line through the layer's last ``window`` finite (step, value) points of
  ``metric`` (``fit``: least squares, or Theil-Sen's median of pairwise slopes) predicts the step
  at which it crosses ``threshold`` in the direction of ``op`` (``>``/``>=``: rising through it;
  ``<``/``<=``: falling through it), or comes within ``margin`` residual standard deviations of it. It fires once, for
  ``for_reports`` consecutive reports, the slope points toward the threshold, the latest value is
  not past it yet (past it, the threshold rule speaks) and the predicted crossing is at most
  ``horizon_steps`` ahead. It resolves when the forecast stops saying so, or when the value
  crosses. The predicted crossing step is in the summary (``layer 3: qkai 0.58 rising
  0.0004/step, crosses 0.70 in about 300 steps (at step ~1450)``) and in
  :attr:`Transition.predicted_step` (the alert's ``predicted_step``), so that a forecast can be
  scored against the step at which the value really crossed. It fires only once it holds
  ``window`` points.

NaN is never evidence (a NaN report does not satisfy any rule, and is left out of baselines and
forecasts); an infinite value is (``inf`` is above every threshold and every growth factor).
Every per-layer rule evaluates each (attempt, step) of a layer once (:meth:`LayerState.seen`),
so replays and late batches change nothing. What growth and forecast rules remember between
batches (the early values, the recent points) is :attr:`LayerState.memory`, bounded by
``baseline_reports`` and ``window`` (at most :data:`MEMORY_MAX` each), and stored with the state.

Rules file (YAML); every field is checked by type, and ``rules`` is required (``rules: []``
switches alerting off: an empty file is an error, not a silent "no alerts"). ``kind`` is one of
``threshold``, ``band``, ``growth``, ``forecast``; left out, a rule with ``band_of`` is a band and
any other a threshold rule. A qkai threshold or forecast rule without a ``threshold`` takes the
collector's collapse threshold (``QKWATCH_COLLAPSE_THRESHOLD``, 0.70 by default); a rule on any
other metric must give its own. ``factor`` (growth) and ``horizon_steps`` (forecast) are required::

    rules:
      - name: qkai_high          # a threshold rule
        metric: qkai
        op: ">"                  # > >= < <=
        threshold: 0.70          # optional for a qkai rule: the collapse threshold setting
        for_reports: 3
        severity: warning
      - name: collapse_band      # a band rule over the layers firing qkai_high
        band_of: qkai_high
        min_layers: 3
        severity: critical
      - name: logit_growth       # a growth rule
        kind: growth
        metric: logit_max
        factor: 3.0              # fires at value / baseline >= factor
        baseline_reports: 5      # the baseline: mean of the layer's first 5 finite values...
        skip_reports: 1          # ...after its first report
        for_reports: 2
      - name: qkai_forecast      # a forecast rule
        kind: forecast
        metric: qkai
        op: ">"
        threshold: 0.70          # optional for qkai: the collapse threshold setting
        window: 8                # reports in the line
        horizon_steps: 500       # fires when the predicted crossing is at most this many steps ahead
        for_reports: 2
        fit: least_squares       # or theil_sen (median of the pairwise slopes; window <= 64)
        margin: 0.0              # residual standard deviations short of the threshold
    webhooks:
      - http://alertmanager-receiver.example/hook

``qkwatch/dashboards/rules/detectors.yml`` is such a file with every kind, its parameters provisional
(to be tuned on the instability suite's tune split).
"""

from __future__ import annotations

import math
import operator
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, as_text
from qkwatch.contract.values import METRIC_NAME_PATTERN
from qkwatch.monitor.settings import check_http_url

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
SEVERITY_MAX = 32
"""Longest severity (the alerts table's column)."""
MEMORY_MAX = 256
"""Most values a growth rule's baseline or a forecast rule's window may hold per layer (the stored state)."""


def _check_name(rule: str, key: str, value: object) -> None:
    """Rule and metric names: what a report's metric name may be (letters, digits, ``_.:/-``)."""
    if not isinstance(value, str) or not re.fullmatch(METRIC_NAME_PATTERN, value):
        raise ValueError(
            f"rule {rule!r}: {key} must be a name of letters, digits and _.:/- "
            f"(starting with a letter or _), got {value!r}"
        )


def _check_int(rule: str, key: str, value: object, low: int = 1, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"rule {rule!r}: {key} must be a whole number {bound}, got {_brief(value)}")


def _check_number(rule: str, key: str, value: object, above: float | None = None) -> None:
    if not _finite(value):
        raise ValueError(f"rule {rule!r}: {key} must be a finite number, got {_brief(value)}")
    assert isinstance(value, (int, float))  # _finite holds only for numbers
    if above is not None and value <= above:
        raise ValueError(f"rule {rule!r}: {key} must be above {above:g}, got {value!r}")


def _finite(value: object) -> bool:
    """A finite int or float (not a bool); an int too large for a float is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # math.isfinite converts an int to a float first
        return False


def _brief(value: object) -> str:
    """``repr`` for an error message, short: a huge int (whose repr may even be refused) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _check_op(rule: str, value: object) -> None:
    if not isinstance(value, str) or value not in _OPS:
        raise ValueError(f"rule {rule!r}: op must be one of {', '.join(_OPS)}, got {value!r}")


def _check_severity(rule: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= SEVERITY_MAX or not value.isprintable():
        raise ValueError(f"rule {rule!r}: severity must be a word of 1 to {SEVERITY_MAX} characters, got {value!r}")


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
        _check_int(self.name, "for_reports", self.for_reports)
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
    """Fires per layer when ``value / baseline >= factor`` for ``for_reports`` consecutive reports.

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
        _check_number(self.name, "factor", self.factor, above=1)
        _check_int(self.name, "baseline_reports", self.baseline_reports, high=MEMORY_MAX)
        _check_int(self.name, "skip_reports", self.skip_reports, low=0)
        _check_int(self.name, "for_reports", self.for_reports)
        _check_severity(self.name, self.severity)

    def describe(self) -> str:
        return f"fires at {self.factor:g}x for {self.for_reports} consecutive reports"


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
        _check_int(self.name, "for_reports", self.for_reports)
        _check_severity(self.name, self.severity)
        if not isinstance(self.fit, str) or self.fit not in FITS:
            raise ValueError(f"rule {self.name!r}: fit must be one of {', '.join(FITS)}, got {_brief(self.fit)}")
        if self.fit == "theil_sen":
            _check_int(self.name, "window (theil_sen)", self.window, low=2, high=THEIL_SEN_WINDOW_MAX)
        _check_number(self.name, "margin", self.margin)
        if self.margin < 0:
            raise ValueError(f"rule {self.name!r}: margin must be 0 or more, got {self.margin!r}")

    @property
    def rising(self) -> bool:
        return self.op in (">", ">=")

    def past(self, value: float) -> bool:
        """The value is already across the threshold (``inf`` is past ``>``; NaN is past nothing)."""
        return not math.isnan(value) and _OPS[self.op](value, self.threshold)

    def forecast(self, points: list[tuple[int, float]]) -> Forecast | None:
        """The line through ``points`` ((step, value), at least ``window`` of them), None when it heads away.

        ``least_squares``: slope = sum (x - x0)(y - y0) / sum (x - x0)^2 about the means (x0, y0),
        through (x0, y0). ``theil_sen``: the median of the slopes of every pair of points, through
        the point (x0, median of y - slope (x - x0)); one outlying report (a jump) moves it little.
        The line reaches a target t at step x0 + (t - y0) / slope, where t is the threshold moved
        toward the values by ``margin`` times the residuals' standard deviation,
        sqrt(sum r^2 / max(n - 2, 1)).
        """
        n = len(points)
        if n < self.window:
            return None
        # Values near the top of the double range (a logit_max of 1e308) would overflow the sums:
        # the crossing step does not change when values and threshold are scaled together, so such
        # a window is fitted in units of a power of two that brings them under 1.
        top = max(abs(self.threshold), *(abs(y) for _, y in points))
        scale = math.ldexp(1.0, math.frexp(top)[1]) if top > _FIT_SCALE_ABOVE else 1.0
        xs = [float(x) for x, _ in points]
        ys = [y / scale for _, y in points]
        x0 = math.fsum(xs) / n
        if self.fit == "theil_sen":
            slope = statistics.median(
                [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
            )
            y0 = statistics.median([y - slope * (x - x0) for x, y in zip(xs, ys, strict=True)])
        else:
            y0 = math.fsum(ys) / n
            slope = math.fsum((x - x0) * (y - y0) for x, y in zip(xs, ys, strict=True)) / math.fsum(
                (x - x0) ** 2 for x in xs
            )
        if not (slope > 0 if self.rising else slope < 0):
            return None
        target = self.threshold / scale
        if self.margin:
            spread = math.sqrt(
                math.fsum((y - y0 - slope * (x - x0)) ** 2 for x, y in zip(xs, ys, strict=True)) / max(n - 2, 1)
            )
            target += -self.margin * spread if self.rising else self.margin * spread
        return Forecast(slope * scale, x0 + (target - y0) / slope)


FITS = ("least_squares", "theil_sen")
"""A forecast rule's lines (ForecastRule.fit)."""
THEIL_SEN_WINDOW_MAX = 64
"""Largest window of a theil_sen forecast: each layer's report takes the median of window (window - 1) / 2 slopes."""


_FIT_SCALE_ABOVE = 2.0**500
"""A forecast's window with a value this large is fitted in scaled units (ForecastRule.forecast)."""

LayerRule = ThresholdRule | GrowthRule | ForecastRule
"""A rule judged layer by layer (a band looks at the layers of a threshold rule)."""
Rule = ThresholdRule | BandRule | GrowthRule | ForecastRule
KINDS: dict[str, type[Rule]] = {
    "threshold": ThresholdRule,
    "band": BandRule,
    "growth": GrowthRule,
    "forecast": ForecastRule,
}
"""The rules file's ``kind`` -> the rule's class."""
_REQUIRED = {"band": ("band_of",), "growth": ("factor",), "forecast": ("horizon_steps",)}


@dataclass(frozen=True)
class RuleSet:
    thresholds: tuple[ThresholdRule, ...]
    bands: tuple[BandRule, ...]
    webhooks: tuple[str, ...] = ()
    growths: tuple[GrowthRule, ...] = ()
    forecasts: tuple[ForecastRule, ...] = ()

    def __post_init__(self) -> None:
        names = [r.name for r in (*self.layer_rules, *self.bands)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule name {dupes[0]!r} is used twice")
        known = {r.name for r in self.thresholds}
        for band in self.bands:
            if band.band_of not in known:
                raise ValueError(f"rule {band.name!r}: band_of {band.band_of!r} is not a threshold rule")

    @property
    def layer_rules(self) -> tuple[LayerRule, ...]:
        """Every rule judged per layer, in the order :func:`evaluate` runs them."""
        return (*self.thresholds, *self.growths, *self.forecasts)

    @property
    def metrics(self) -> set[str]:
        """The metrics the rules read (a report with none of them changes nothing)."""
        return {r.metric for r in self.layer_rules}

    @classmethod
    def default(cls, collapse: float = COLLAPSE_THRESHOLD) -> RuleSet:
        """``qkai > collapse`` on a layer for 3 consecutive reports; a band of >= 3 adjacent such layers."""
        return cls(
            thresholds=(ThresholdRule("qkai_high", threshold=collapse),),
            bands=(BandRule("collapse_band", band_of="qkai_high"),),
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], collapse: float = COLLAPSE_THRESHOLD) -> RuleSet:
        """Parse the rules file's structure; ValueError names the offending rule or key.

        ``rules`` is required: ``rules: []`` switches alerting off on purpose, while a file that
        says nothing is more likely a mistake than a wish for no alerts. A qkai threshold or
        forecast rule without a ``threshold`` gets ``collapse`` (the collector's setting).
        """
        if not isinstance(data, Mapping):
            raise ValueError("the rules file must be a mapping with 'rules' (and optionally 'webhooks')")
        unknown = sorted(set(data) - {"rules", "webhooks"})
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} in the rules file")
        if "rules" not in data:
            raise ValueError("the rules file has no 'rules'; write 'rules: []' to switch alerting off")
        items = data["rules"]
        if not isinstance(items, list):
            raise ValueError(f"rules must be a list of rules (or [] for none), got {items!r}")
        parsed = [_parse_rule(item, i, collapse) for i, item in enumerate(items)]
        webhooks = data.get("webhooks") or []
        if not isinstance(webhooks, list):
            raise ValueError(f"webhooks must be a list of http(s) URLs, got {_brief(webhooks)}")
        for i, url in enumerate(webhooks):
            try:
                check_http_url(url)
            except ValueError as exc:
                raise ValueError(f"webhooks[{i}]: {exc}") from None
        return cls(
            thresholds=tuple(r for r in parsed if isinstance(r, ThresholdRule)),
            bands=tuple(r for r in parsed if isinstance(r, BandRule)),
            webhooks=tuple(webhooks),
            growths=tuple(r for r in parsed if isinstance(r, GrowthRule)),
            forecasts=tuple(r for r in parsed if isinstance(r, ForecastRule)),
        )

    @classmethod
    def from_file(cls, path: Path, collapse: float = COLLAPSE_THRESHOLD) -> RuleSet:
        """Read and validate a rules file; ValueError (one line) for anything wrong, reading it included."""
        import yaml  # only needed when a rules file is configured

        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ValueError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
        if data is None:
            raise ValueError("the rules file is empty; write 'rules: []' to switch alerting off")
        return cls.from_mapping(data, collapse)


def _parse_rule(item: object, i: int, collapse: float) -> Rule:
    """One entry of ``rules``: its kind (given, or band/threshold by ``band_of``), checked key by key."""
    if not isinstance(item, Mapping) or "name" not in item:
        raise ValueError(f"rules[{i}] must be a mapping with a 'name'")
    where = f"rules[{i}] ({item.get('name')!r})"
    kind = item.get("kind", "band" if "band_of" in item else "threshold")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    rule_class = KINDS[kind]
    fields_ = {f.name for f in fields(rule_class)}
    unknown = sorted(set(item) - fields_ - {"kind"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} for a {kind} rule (keys: {', '.join(sorted(fields_))})")
    for key in _REQUIRED.get(kind, ()):
        if key not in item:
            raise ValueError(f"{where}: {key} is required for a {kind} rule")
    values = {k: v for k, v in item.items() if k != "kind"}
    if kind in ("threshold", "forecast"):
        values = _with_threshold(values, i, collapse)
    return rule_class(**values)


def _with_threshold(item: Mapping[str, Any], i: int, collapse: float) -> dict[str, Any]:
    """A threshold or forecast rule's fields, a qkai rule's omitted threshold filled with the collapse threshold.

    Any other metric has no threshold to inherit: QKAI's collapse threshold means nothing on its scale.
    """
    if "threshold" in item:
        return dict(item)
    if item.get("metric", "qkai") != "qkai":
        raise ValueError(
            f"rules[{i}] ({item.get('name')!r}): threshold is required for metric {item.get('metric')!r} "
            f"(only a qkai rule defaults to the collapse threshold, {as_text(collapse)})"
        )
    return {**item, "threshold": collapse}


@dataclass
class LayerState:
    """What a rule remembers about one layer (``layer`` -1 holds a band rule's state)."""

    streak: int = 0
    since_step: int | None = None
    firing: bool = False
    attempt: int = 0
    step: int = -1
    band_layers: tuple[int, ...] = ()
    memory: dict[str, Any] | None = None
    """A growth or forecast rule's values (JSON-able, replaced, never changed in place): a growth
    rule's ``{"skipped": n, "early": [values]}``, a forecast rule's ``{"points": [[step, value], ...],
    "predicted": step}`` (``predicted``: the crossing step it fired with)."""

    def seen(self, attempt: int, step: int) -> bool:
        """True when (attempt, step) was already evaluated: replays and late reports are skipped."""
        return (attempt, step) <= (self.attempt, self.step)


@dataclass(frozen=True)
class ReportValues:
    """The part of one report the rules look at."""

    attempt: int
    step: int
    layers: Mapping[str, list[float | None]]


@dataclass(frozen=True)
class Transition:
    """A rule started or stopped firing (``kind`` "firing" or "resolved"), or a band changed ("update")."""

    kind: str
    rule: str
    severity: str
    metric: str
    layers: tuple[int, ...]
    onset_step: int
    step: int
    summary: str
    state_key: tuple[str, int] = field(default=("", 0))
    predicted_step: int | None = None
    """A forecast's predicted crossing step (None for the other kinds, and on resolution)."""


def evaluate(
    rules: RuleSet, state: dict[tuple[str, int], LayerState], reports: Iterable[ReportValues]
) -> list[Transition]:
    """Advance ``state`` (mutated in place) over ``reports`` and return the transitions.

    Reports are taken in (attempt, step) order; one already evaluated for a layer is skipped,
    so replaying a batch or a late batch never double-counts a streak. Per report the rules run
    in the order threshold, growth, forecast, band.
    """
    out: list[Transition] = []
    for report in sorted(reports, key=lambda r: (r.attempt, r.step)):
        for rule in rules.thresholds:
            out += _threshold(rule, state, report)
        for growth in rules.growths:
            out += _per_layer(growth, state, report)
        for forecast in rules.forecasts:
            out += _per_layer(forecast, state, report)
        for band in rules.bands:
            out += _band(band, rules, state, report)
    return out


def _threshold(rule: ThresholdRule, state: dict[tuple[str, int], LayerState], report: ReportValues) -> list[Transition]:
    out = []
    for layer, value in enumerate(report.layers.get(rule.metric, ())):
        if value is None:
            continue
        st = state.setdefault((rule.name, layer), LayerState())
        if st.seen(report.attempt, report.step):
            continue
        st.attempt, st.step = report.attempt, report.step
        if rule.holds(value):
            if not st.streak or st.since_step is None:  # the streak starts at this report
                st.since_step = report.step
            st.streak += 1
            if st.streak >= rule.for_reports and not st.firing:
                st.firing = True
                out.append(
                    Transition(
                        "firing",
                        rule.name,
                        rule.severity,
                        rule.metric,
                        (layer,),
                        st.since_step,
                        report.step,
                        f"layer {layer}: {rule.describe()} ({value:.4g} at onset)",
                        (rule.name, layer),
                    )
                )
        else:
            if st.firing:
                out.append(
                    Transition(
                        "resolved",
                        rule.name,
                        rule.severity,
                        rule.metric,
                        (layer,),
                        st.since_step or report.step,
                        report.step,
                        f"layer {layer}: {rule.metric} back to {value:.4g}",
                        (rule.name, layer),
                    )
                )
            st.streak, st.since_step, st.firing = 0, None, False
    return out


@dataclass(frozen=True)
class _Verdict:
    """What a growth or forecast rule makes of one layer's report."""

    holds: bool
    summary: str
    """Why it fires, when ``holds``; why it no longer does, when not."""
    predicted_step: int | None = None


def _per_layer(
    rule: GrowthRule | ForecastRule, state: dict[tuple[str, int], LayerState], report: ReportValues
) -> list[Transition]:
    """A growth or forecast rule over one report: the same streak, onset and resolution as a threshold rule."""
    out = []
    for layer, value in enumerate(report.layers.get(rule.metric, ())):
        if value is None:
            continue
        st = state.setdefault((rule.name, layer), LayerState())
        if st.seen(report.attempt, report.step):
            continue
        st.attempt, st.step = report.attempt, report.step
        verdict = (
            _judge_growth(rule, st, layer, value)
            if isinstance(rule, GrowthRule)
            else _judge_forecast(rule, st, layer, value, report.step)
        )
        if verdict.holds:
            if not st.streak or st.since_step is None:
                st.since_step = report.step
            st.streak += 1
            if st.streak >= rule.for_reports and not st.firing:
                st.firing = True
                if verdict.predicted_step is not None:
                    st.memory = {**(st.memory or {}), "predicted": verdict.predicted_step}
                out.append(_transition("firing", rule, layer, st.since_step, report.step, verdict))
            continue
        if st.firing:
            out.append(_transition("resolved", rule, layer, st.since_step or report.step, report.step, verdict))
            if st.memory and "predicted" in st.memory:
                st.memory = {k: v for k, v in st.memory.items() if k != "predicted"}
        st.streak, st.since_step, st.firing = 0, None, False
    return out


def _transition(
    kind: str, rule: GrowthRule | ForecastRule, layer: int, onset: int, step: int, verdict: _Verdict
) -> Transition:
    predicted = verdict.predicted_step if kind == "firing" else None
    key = (rule.name, layer)
    return Transition(
        kind, rule.name, rule.severity, rule.metric, (layer,), onset, step, verdict.summary, key, predicted
    )


def _judge_growth(rule: GrowthRule, st: LayerState, layer: int, value: float) -> _Verdict:
    """Skip, then gather the baseline, then compare ``value / baseline`` with the factor."""
    memory = st.memory or {}
    skipped: int = memory.get("skipped", 0)
    early: list[float] = memory.get("early", [])
    if skipped < rule.skip_reports:
        st.memory = {"skipped": skipped + 1, "early": early}
        return _Verdict(False, "")
    if len(early) < rule.baseline_reports:
        if math.isfinite(value):
            st.memory = {"skipped": skipped, "early": [*early, value]}
        return _Verdict(False, "")
    baseline = _mean(early)
    if not baseline > 0:
        return _Verdict(False, f"layer {layer}: {rule.metric} has no positive early value ({baseline:.4g})")
    if math.isnan(value):
        return _Verdict(False, f"layer {layer}: {rule.metric} is NaN")
    ratio = value / baseline
    if ratio >= rule.factor:
        return _Verdict(
            True,
            f"layer {layer}: {rule.metric} {ratio:.1f}x its early value ({value:.4g} vs {baseline:.4g}; "
            f"{rule.describe()})",
        )
    return _Verdict(
        False, f"layer {layer}: {rule.metric} back to {ratio:.1f}x its early value ({value:.4g} vs {baseline:.4g})"
    )


def _mean(values: list[float]) -> float:
    """The mean of finite values, finite even when their sum is not (values near 1.7e308)."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


def _judge_forecast(rule: ForecastRule, st: LayerState, layer: int, value: float, step: int) -> _Verdict:
    """Add the point to the window, fit the line, and say whether it crosses within the horizon.

    A forecast warns of the layer's first crossing: once the value has been past the threshold, the
    layer gets no forecast again (the threshold rule speaks for it; a value hovering about the
    threshold would otherwise be forecast to cross "about now" at every dip). Points at or after
    ``step``, and a first crossing at or after it, belong to an attempt that a resume (from an
    earlier checkpoint) replaced: they are forgotten.
    """
    memory = st.memory or {}
    points = [(int(x), float(y)) for x, y in memory.get("points", []) if x < step]
    if math.isfinite(value):
        points = [*points, (step, value)][-rule.window :]
    crossed = memory.get("crossed")
    crossed = int(crossed) if crossed is not None and crossed < step else None
    st.memory = {k: v for k, v in memory.items() if k != "crossed"} | {"points": [[x, y] for x, y in points]}
    threshold = as_text(rule.threshold)
    if rule.past(value):
        st.memory["crossed"] = crossed if crossed is not None else step
        said = memory.get("predicted")
        forecast = f" (forecast: step ~{said})" if said is not None else ""
        return _Verdict(
            False, f"layer {layer}: {rule.metric} crossed {threshold}: {value:.4g} at step {step}{forecast}"
        )
    if crossed is not None:
        st.memory["crossed"] = crossed
        return _Verdict(False, f"layer {layer}: {rule.metric} crossed {threshold} at step {crossed} already")
    fc = rule.forecast(points) if math.isfinite(value) else None
    if fc is None or fc.crossing - step > rule.horizon_steps:
        return _Verdict(
            False,
            f"layer {layer}: {rule.metric} {value:.3g} no longer forecast to cross {threshold} "
            f"within {rule.horizon_steps} steps",
        )
    # A line that is past the threshold already (the value not yet: noise about it) crosses now;
    # its crossing may lie far back, even at -inf for a slope near 0.
    predicted = step if fc.crossing <= step else round(fc.crossing)
    direction = "rising" if fc.slope > 0 else "falling"
    when = f"in about {_about(predicted - step)} steps" if predicted > step else "about now"
    return _Verdict(
        True,
        f"layer {layer}: {rule.metric} {value:.3g} {direction} {abs(fc.slope):.2g}/step, crosses {threshold} "
        f"{when} (at step ~{predicted})",
        predicted,
    )


def _about(steps: int) -> int:
    """A number of steps to two significant digits: 297 -> 300, 1234 -> 1200, 7 -> 7."""
    return int(float(f"{steps:.2g}"))


def _band(
    band: BandRule, rules: RuleSet, state: dict[tuple[str, int], LayerState], report: ReportValues
) -> list[Transition]:
    base = next(r for r in rules.thresholds if r.name == band.band_of)
    if base.metric not in report.layers:
        return []
    st = state.setdefault((band.name, -1), LayerState())
    if st.seen(report.attempt, report.step):
        return []
    st.attempt, st.step = report.attempt, report.step
    firing = sorted(layer for (name, layer), s in state.items() if name == base.name and s.firing)
    layers = tuple(band_layers(firing, band.min_layers))
    summary = f"collapse band: {len(layers)} adjacent layers {_span(layers)} fire {base.name}"
    if layers and not st.firing:
        st.firing, st.since_step, st.band_layers = True, report.step, layers
        return [
            Transition(
                "firing",
                band.name,
                band.severity,
                base.metric,
                layers,
                report.step,
                report.step,
                summary,
                (band.name, -1),
            )
        ]
    if st.firing and not layers:
        old = st.band_layers
        st.firing, st.band_layers = False, ()
        return [
            Transition(
                "resolved",
                band.name,
                band.severity,
                base.metric,
                old,
                st.since_step or report.step,
                report.step,
                f"collapse band over layers {_span(old)} resolved",
                (band.name, -1),
            )
        ]
    if st.firing and layers != st.band_layers:
        st.band_layers = layers
        return [
            Transition(
                "update",
                band.name,
                band.severity,
                base.metric,
                layers,
                st.since_step or report.step,
                report.step,
                summary,
                (band.name, -1),
            )
        ]
    return []


def band_layers(firing: Iterable[int], min_layers: int) -> list[int]:
    """Layers that belong to a run of at least ``min_layers`` adjacent firing layers."""
    out: list[int] = []
    run: list[int] = []
    for layer in sorted(set(firing)):
        if run and layer != run[-1] + 1:
            out += run if len(run) >= min_layers else []
            run = []
        run.append(layer)
    return out + (run if len(run) >= min_layers else [])


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "-"


def with_webhooks(rules: RuleSet, urls: Iterable[str]) -> RuleSet:
    """The same rules with extra webhook receivers (from the settings)."""
    return replace(rules, webhooks=tuple(dict.fromkeys((*rules.webhooks, *urls))))
