"""The detectors every suite scores: the user's collapse rules, each family's candidates, the shipped file.

:data:`FIXED` and :data:`FAMILIES` are what the earlier suite (``experiments.instability``) and the
sweep (``experiments.sweep_analysis``) tune and score; :data:`DETECTORS` is the candidate detectors'
rules file as users get it, whose ``qkai_forecast`` (:func:`shipped_forecast`) the forecast studies
measure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from experiments.common import ROOT

FIXED: list[dict[str, Any]] = [
    {"name": "qkai_high", "metric": "qkai", "op": ">", "for_reports": 3},
    {"name": "collapse_band", "band_of": "qkai_high", "min_layers": 3, "severity": "critical"},
]
"""The user's collapse rules: kept as they are, never tuned."""


FAMILIES: dict[str, list[dict[str, Any]]] = {
    "logit_growth": [
        {
            "kind": "growth",
            "metric": "logit_max",
            "factor": f,
            "baseline_reports": 5,
            "skip_reports": 1,
            "for_reports": n,
        }
        for f in (1.5, 2.0, 3.0, 5.0)
        for n in (2, 3)
    ],
    "attn_one_hot": [
        {"metric": "attn_entropy", "op": "<", "threshold": x, "for_reports": 3} for x in (0.05, 0.1, 0.2, 0.3)
    ],
    "attn_uniform": [
        {"metric": "attn_entropy", "op": ">", "threshold": x, "for_reports": 3} for x in (0.95, 0.97, 0.98, 0.99)
    ],
    "stable_rank_low": [
        {"metric": "stable_rank", "op": "<", "threshold": x, "for_reports": 3} for x in (1.1, 1.2, 1.3, 1.5)
    ],
    "qkai_forecast": [
        {"kind": "forecast", "metric": "qkai", "op": ">", "window": w, "horizon_steps": h, "for_reports": n}
        for w in (6, 10)
        for h in (100, 250, 500)
        for n in (1, 2)
    ],
    "stable_rank_forecast": [
        {
            "kind": "forecast",
            "metric": "stable_rank",
            "op": "<",
            "threshold": x,
            "window": w,
            "horizon_steps": h,
            "for_reports": 2,
        }
        for x in (1.2, 1.5)
        for w in (6, 10)
        for h in (100, 250)
    ],
}
"""Each detector family's candidate parameters, in order from the most conservative; the first
candidate with the best tune score wins a tie."""


DETECTORS = ROOT.parent / "qkwatch" / "dashboards" / "rules" / "detectors.yml"
"""The candidate detectors' rules file, whose qkai_forecast is the forecast users are given."""


def shipped_forecast(path: Path = DETECTORS) -> dict[str, Any]:
    """The qkai_forecast rule of ``qkwatch/dashboards/rules/detectors.yml`` as the file holds it now: its crossing
    error is measured beside the candidates, whether or not tuning chose it."""
    rules = yaml.safe_load(path.read_text())["rules"]
    (rule,) = [r for r in rules if r["name"] == "qkai_forecast"]
    return {k: v for k, v in rule.items() if k != "severity"}


def shipped_detectors() -> list[dict[str, Any]]:
    """The candidate detectors' file as users get it, less the user's collapse rules (scored already)."""
    fixed = {r["name"] for r in FIXED}
    return [r for r in yaml.safe_load(DETECTORS.read_text())["rules"] if r["name"] not in fixed]
