"""The Prometheus alert rules, rendered from ``qkwatch.yml.template`` with the collapse threshold.

The template is the rules file as it is committed, comments and folded annotations included, with
``@{collapse}`` where the threshold goes: in the exprs and in the annotation texts that on-call reads.
``@`` marks placeholders because ``$`` and ``{{ }}`` belong to Prometheus's own templating; ``@@`` is
a literal ``@``. ``python -m dashboards.generate`` writes the result to ``rules/qkwatch.yml``.
"""

from __future__ import annotations

import string
from pathlib import Path

from qkwatch.monitor.thresholds import Thresholds, as_text

TEMPLATE = Path(__file__).resolve().with_name("qkwatch.yml.template")


class RulesTemplate(string.Template):
    """``@{name}`` placeholders, leaving Prometheus's ``$labels`` and ``{{ }}`` alone."""

    delimiter = "@"


def render(thresholds: Thresholds) -> dict[str, str]:
    """Relative path (under dashboards/prometheus) -> the file's exact text.

    Raises:
        KeyError: the template names a placeholder other than ``collapse`` and ``h_star``.
    """
    values = {"collapse": as_text(thresholds.collapse), "h_star": as_text(thresholds.h_star)}
    return {"rules/qkwatch.yml": RulesTemplate(TEMPLATE.read_text()).substitute(values)}
