"""The Prometheus alert rules, rendered from ``qkwatch.yml.template`` with the thresholds and the detectors.

The template is the rules file as it is committed, comments and folded annotations included, with
``@{collapse}`` where the threshold goes: in the exprs and in the annotation texts that on-call reads.
The detectors' parameters come from the collector's candidate rules file,
``qkwatch/dashboards/rules/detectors.yml``, so that Prometheus and the collector judge with the same
numbers: ``@{stable_rank_low}`` (the threshold of its ``stable_rank_low``), ``@{entropy_high}``
(``attn_uniform``), ``@{entropy_low}`` (``attn_one_hot``) and ``@{growth_factor}``
(``logit_growth``). ``@`` marks placeholders because ``$`` and ``{{ }}`` belong to Prometheus's own
templating; ``@@`` is a literal ``@``. ``python -m qkwatch.dashboards.generate`` writes the result to
``rules/qkwatch.yml``.
"""

from __future__ import annotations

import string
from pathlib import Path

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.rules.kinds import GrowthRule, ThresholdRule
from qkwatch.rules.ruleset import RuleSet

TEMPLATE = Path(__file__).resolve().with_name("qkwatch.yml.template")
DETECTORS = Path(__file__).resolve().parents[1] / "rules" / "detectors.yml"
"""The candidate rules file whose detectors' parameters the Prometheus rules take."""


class RulesTemplate(string.Template):
    """``@{name}`` placeholders, leaving Prometheus's ``$labels`` and ``{{ }}`` alone."""

    delimiter = "@"


def detector_values(rules: RuleSet) -> dict[str, str]:
    """The template's detector placeholders from ``rules`` (the candidates file).

    Raises:
        ValueError: a rule the Prometheus rules mirror is missing, or is not of the kind expected.
    """
    by_name = {r.name: r for r in rules.layer_rules}

    def threshold(name: str) -> str:
        found = by_name.get(name)
        if not isinstance(found, ThresholdRule):
            raise ValueError(f"{DETECTORS.name}: the Prometheus rules need a threshold rule named {name!r}")
        return as_text(found.threshold)

    growth = by_name.get("logit_growth")
    if not isinstance(growth, GrowthRule):
        raise ValueError(f"{DETECTORS.name}: the Prometheus rules need a growth rule named 'logit_growth'")
    factor = f"{growth.factor:g}"
    return {
        "stable_rank_low": threshold("stable_rank_low"),
        "entropy_high": threshold("attn_uniform"),
        "entropy_low": threshold("attn_one_hot"),
        "growth_factor": factor if float(factor) == growth.factor else repr(growth.factor),
    }


def render(thresholds: Thresholds, detectors: Path = DETECTORS) -> dict[str, str]:
    """Relative path (under qkwatch/dashboards/prometheus) -> the file's exact text.

    Raises:
        KeyError: the template names a placeholder other than ``collapse``, ``h_star`` and the detectors'.
        ValueError: the detectors file is invalid or lacks a rule the template mirrors.
    """
    values = {"collapse": as_text(thresholds.collapse), "h_star": as_text(thresholds.h_star)}
    values.update(detector_values(RuleSet.from_file(detectors, thresholds.collapse)))
    return {"rules/qkwatch.yml": RulesTemplate(TEMPLATE.read_text()).substitute(values)}
