"""Alert evaluation, pure: rules + per-layer state + new reports -> transitions (no I/O).

:func:`evaluate` takes each report through the rules (:mod:`qkwatch.rules.kinds` says
what each kind means) and returns the alerts that start, stop or change (:class:`Transition`); the
alert evaluator (:mod:`qkwatch.rules.evaluator`) turns those into alerts and keeps the
:class:`LayerState` between batches.

NaN is never evidence (a NaN report does not satisfy any rule, and is left out of baselines and
forecasts); an infinite value is (``inf`` is above every threshold and every growth factor).
Every per-layer rule evaluates each (attempt, step) of a layer once (:meth:`LayerState.seen`),
so replays and late batches change nothing. What growth and forecast rules remember between
batches (the early values, the recent points) is :attr:`LayerState.memory`, bounded by
``baseline_reports`` and ``window`` (at most :data:`~qkwatch.rules.kinds.MEMORY_MAX`
each), and stored with the state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qkwatch.contract.thresholds import as_text
from qkwatch.rules.forecast import fit_line
from qkwatch.rules.kinds import BandRule, ForecastRule, GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet


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
    if rule.holds(ratio):
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
    fc = fit_line(rule, points) if math.isfinite(value) else None
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
