"""Alert rules, pure: rules + per-layer state + new reports -> transitions (no I/O).

Persistence is counted in *reports*, not wall-clock time (Prometheus ``for:`` counts seconds,
which mean nothing to a run that may pause for a checkpoint): a threshold rule fires on a layer
once its condition held for ``for_reports`` consecutive reports of that layer, and resolves at
the first report where it no longer holds. A band rule fires while at least ``min_layers``
adjacent layers fire a threshold rule (the collapse band of seed 000).

Rules file (YAML); every field is checked by type, and ``rules`` is required (``rules: []``
switches alerting off: an empty file is an error, not a silent "no alerts"). A qkai rule without a
``threshold`` takes the collector's collapse threshold (``QKWATCH_COLLAPSE_THRESHOLD``, 0.70 by default);
a rule on any other metric must give its own::

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
    webhooks:
      - http://alertmanager-receiver.example/hook
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qkwatch.monitor.thresholds import COLLAPSE_THRESHOLD, as_text
from qkwatch.monitor.wire import METRIC_NAME_PATTERN

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
SEVERITY_MAX = 32
"""Longest severity (the alerts table's column)."""


def _check_name(rule: str, key: str, value: object) -> None:
    """Rule and metric names: what a report's metric name may be (letters, digits, ``_.:/-``)."""
    if not isinstance(value, str) or not re.fullmatch(METRIC_NAME_PATTERN, value):
        raise ValueError(
            f"rule {rule!r}: {key} must be a name of letters, digits and _.:/- "
            f"(starting with a letter or _), got {value!r}"
        )


def _check_int(rule: str, key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"rule {rule!r}: {key} must be a whole number >= 1, got {value!r}")


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
        if not isinstance(self.op, str) or self.op not in _OPS:
            raise ValueError(f"rule {self.name!r}: op must be one of {', '.join(_OPS)}, got {self.op!r}")
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, (int, float))
            or not math.isfinite(self.threshold)
        ):
            raise ValueError(f"rule {self.name!r}: threshold must be a finite number, got {self.threshold!r}")
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
class RuleSet:
    thresholds: tuple[ThresholdRule, ...]
    bands: tuple[BandRule, ...]
    webhooks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [r.name for r in self.thresholds] + [b.name for b in self.bands]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule name {dupes[0]!r} is used twice")
        known = {r.name for r in self.thresholds}
        for band in self.bands:
            if band.band_of not in known:
                raise ValueError(f"rule {band.name!r}: band_of {band.band_of!r} is not a threshold rule")

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
        says nothing is more likely a mistake than a wish for no alerts. A qkai rule without a
        ``threshold`` gets ``collapse`` (the collector's setting).
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
        thresholds, bands = [], []
        for i, item in enumerate(items):
            if not isinstance(item, Mapping) or "name" not in item:
                raise ValueError(f"rules[{i}] must be a mapping with a 'name'")
            try:
                if "band_of" in item:
                    bands.append(BandRule(**item))
                else:
                    thresholds.append(ThresholdRule(**_with_threshold(item, i, collapse)))
            except TypeError as exc:
                raise ValueError(f"rules[{i}] ({item.get('name')!r}): {exc}") from None
        webhooks = data.get("webhooks") or []
        if not isinstance(webhooks, list) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in webhooks
        ):
            raise ValueError("webhooks must be a list of http(s) URLs")
        return cls(tuple(thresholds), tuple(bands), tuple(webhooks))

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


def _with_threshold(item: Mapping[str, Any], i: int, collapse: float) -> Mapping[str, Any]:
    """A threshold rule's fields, a qkai rule's omitted threshold filled with the collapse threshold.

    Any other metric has no threshold to inherit: QKAI's collapse threshold means nothing on its scale.
    """
    if "threshold" in item:
        return item
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


def evaluate(
    rules: RuleSet, state: dict[tuple[str, int], LayerState], reports: Iterable[ReportValues]
) -> list[Transition]:
    """Advance ``state`` (mutated in place) over ``reports`` and return the transitions.

    Reports are taken in (attempt, step) order; one already evaluated for a layer is skipped,
    so replaying a batch or a late batch never double-counts a streak.
    """
    out: list[Transition] = []
    for report in sorted(reports, key=lambda r: (r.attempt, r.step)):
        for rule in rules.thresholds:
            out += _threshold(rule, state, report)
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
