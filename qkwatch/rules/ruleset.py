"""The rules file: :class:`RuleSet`, the collector's rules read from YAML and checked field by field.

What each kind of rule means is :mod:`qkwatch.rules.kinds`; this module only reads and
validates the file, so that a mistake in it stops the collector at start-up with one line naming
the rule and the key, rather than silently alerting on less.

Rules file (YAML); every field is checked by type, and ``rules`` is required (``rules: []``
switches alerting off: an empty file is an error, not a silent "no alerts"). ``kind`` is one of
``threshold``, ``band``, ``growth``, ``forecast``; left out, a rule with ``band_of`` is a band and
any other a threshold rule. A threshold or forecast rule on a metric on QKAI's scale (the catalogue,
``qkwatch.contract.metrics``: qkai, qkai_max) without a ``threshold`` takes the collector's collapse
threshold (``QKWATCH_COLLAPSE_THRESHOLD``, 0.70 by default); a rule on any other metric must give
its own, and a threshold outside the metric's catalogue range is refused. ``factor`` (growth) and
``horizon_steps`` (forecast) are required::

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
        factor: 3.0              # fires at value / baseline >= factor (below 1: <= factor, a fall)
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from qkwatch.contract.metrics import CATALOGUE
from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, as_text
from qkwatch.contract.urls import check_http_url
from qkwatch.rules.kinds import (
    BandRule,
    ForecastRule,
    GrowthRule,
    LayerRule,
    Rule,
    ThresholdRule,
    brief_repr,
    finite,
)

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
    """The collector's rules by kind, and the webhooks their alerts are sent to."""

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
        """Every rule judged per layer, in the order :func:`.transitions.evaluate` runs them."""
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
            raise ValueError(f"rules must be a list of rules (or [] for none), got {brief_repr(items)}")
        if len(items) > MAX_RULES:
            raise ValueError(f"{len(items)} rules; a rules file holds at most {MAX_RULES}")
        parsed = [_parse_rule(item, i, collapse) for i, item in enumerate(items)]
        webhooks = data.get("webhooks") or []
        if not isinstance(webhooks, list):
            raise ValueError(f"webhooks must be a list of http(s) URLs, got {brief_repr(webhooks)}")
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
            size = Path(path).stat().st_size
            if size > MAX_RULES_FILE_BYTES:
                raise ValueError(f"it is {size} bytes; a rules file is at most {MAX_RULES_FILE_BYTES}")
            data = yaml.load(Path(path).read_text(), Loader=_no_alias_loader())  # a SafeLoader, aliases refused
        except OSError as exc:
            raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
        except ValueError as exc:  # the constructor's: an integer of more digits than Python reads
            raise ValueError(f"not valid YAML: a number too long to read ({str(exc).split(':')[0]})") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ValueError(f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
        if data is None:
            raise ValueError("the rules file is empty; write 'rules: []' to switch alerting off")
        return cls.from_mapping(data, collapse)


MAX_RULES = 1000
"""Most rules one file may hold: each is judged on every layer of every report."""
MAX_RULES_FILE_BYTES = 1 << 20
"""Largest rules file read (1 MiB): YAML is parsed in Python, so its size bounds the time and memory."""


def _no_alias_loader() -> type:
    """yaml's SafeLoader refusing anchors and aliases: a few aliases nest into a structure of billions of
    items (the "billion laughs"), and a rules file has no need of them."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.YAMLError(f"anchors and aliases are not allowed in a rules file (line {mark.line + 1})")
            return super().compose_node(parent, index)

    return Loader


def _parse_rule(item: object, i: int, collapse: float) -> Rule:
    """One entry of ``rules``: its kind (given, or band/threshold by ``band_of``), checked key by key."""
    if not isinstance(item, Mapping) or "name" not in item:
        raise ValueError(f"rules[{i}] must be a mapping with a 'name'")
    where = f"rules[{i}] ({brief_repr(item.get('name'))})"
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
    """A threshold or forecast rule's fields, read against the metric's catalogue entry
    (``qkwatch.contract.metrics``): an omitted threshold is the collapse threshold for a metric on
    QKAI's scale (the entry's ``threshold`` is ``collapse``: qkai, qkai_max), and a threshold outside
    the metric's range (``low``, ``high``) is refused, as a rule that could never fire or always would.

    Any other metric has no threshold to inherit: QKAI's collapse threshold means nothing on its scale.
    """
    metric = item.get("metric", "qkai")
    entry = CATALOGUE.get(metric) if isinstance(metric, str) else None
    where = f"rules[{i}] ({item.get('name')!r})"
    if "threshold" not in item:
        if entry is None or entry.threshold != "collapse":
            inherits = ", ".join(m.name for m in CATALOGUE.values() if m.threshold == "collapse")
            raise ValueError(
                f"{where}: threshold is required for metric {metric!r} (only a metric on QKAI's scale, "
                f"{inherits}, defaults to the collapse threshold, {as_text(collapse)})"
            )
        return {**item, "threshold": collapse}
    threshold = item["threshold"]
    if entry is not None and finite(threshold):  # anything else: the rule's own check names it
        low = -float("inf") if entry.low is None else entry.low
        high = float("inf") if entry.high is None else entry.high
        if not low <= threshold <= high:
            raise ValueError(
                f"{where}: threshold {as_text(threshold)} is outside {metric}'s range "
                f"[{as_text(low)}, {as_text(high)}] ({entry.display}, qkwatch.contract.metrics)"
            )
    return dict(item)


def with_webhooks(rules: RuleSet, urls: Iterable[str]) -> RuleSet:
    """The same rules with extra webhook receivers (from the settings)."""
    return replace(rules, webhooks=tuple(dict.fromkeys((*rules.webhooks, *urls))))
