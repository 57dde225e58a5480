"""The earlier suite's QKAI forecast: each alert's predicted crossing against the real one, and the grid tuned on it.

:func:`forecast_errors` measures a forecast rule's crossing error on runs read back
(:class:`experiments.early_warning.earlier_suite.RunData`); :func:`forecast_tuning` chooses the
forecast of :data:`FORECAST_GRID` on the induced tune runs and judges it on the test ones
(``python -m experiments.instability --forecast``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from experiments.early_warning.earlier_suite import RunData, ruleset
from qkwatch.client import backtest
from qkwatch.client.run_history import RunHistory


def forecast_errors(
    data: Sequence[RunData], chosen: dict[str, dict[str, Any]], collapse: float
) -> list[dict[str, Any]]:
    """Each forecast alert's predicted crossing step against the step its layer really crossed.

    The error is relative to the time the forecast looked ahead: ``|predicted - actual| / (actual -
    fired)``. A forecast whose layer never crossed by the end of the run is listed without an error.
    """
    out = []
    forecasts = list(
        {
            json.dumps(c["rule"], sort_keys=True): c["rule"]
            for c in chosen.values()
            if c["rule"].get("kind") == "forecast"
        }.values()
    )
    for rule in forecasts:
        rs = ruleset([rule], collapse)
        spec = rs.forecasts[0]
        for d in data:
            for firing in backtest.replay(rs, d.history.reports):
                if firing.predicted_step is None:
                    continue
                (layer,) = firing.layers
                actual = _crossing(d.history, spec.metric, spec.op, spec.threshold, layer, firing.step)
                error = None if actual is None else abs(firing.predicted_step - actual) / max(actual - firing.step, 1)
                out.append(
                    {
                        "run": d.run.name,
                        "rule": rule["name"],
                        "layer": layer,
                        "fired": firing.step,
                        "predicted": firing.predicted_step,
                        "actual": actual,
                        "relative_error": error,
                    }
                )
    return out


FORECAST_GRID: list[dict[str, Any]] = [
    {
        "name": "qkai_forecast",
        "kind": "forecast",
        "metric": "qkai",
        "op": ">",
        "fit": fit,
        "window": w,
        "horizon_steps": h,
        "for_reports": n,
        "margin": m,
    }
    for fit in ("least_squares", "theil_sen")
    for w in (6, 10, 16, 24, 32)
    for h in (100, 250, 500)
    for n in (1, 2, 3)
    for m in (0.0, 1.0)
]
"""The QKAI forecasts tried for their crossing error (forecast_tuning): the line's fit, its window in
reports, the horizon, the reports running and the margin in residual standard deviations."""


FORECAST_MIN_LEAD_STEPS = 25
"""A forecast candidate must look at least this far ahead (median over its forecasts that crossed, on
tune): 5 reports of the collapse runs. A forecast made a report before the crossing is right and useless."""


def forecast_tuning(tune: Sequence[RunData], test: Sequence[RunData], collapse: float) -> dict[str, Any]:
    """The QKAI forecast chosen for its crossing error on the induced tune runs, then judged on test.

    Only induced runs cross the collapse threshold here, so the forecast's error can only be measured
    on them. Fixed before any candidate was scored on the runs of this rule: a candidate of
    :data:`FORECAST_GRID` is eligible when, on every tune run, at least one of its forecasts crossed,
    and the median lead (actual crossing - step it fired) of those is at least
    :data:`FORECAST_MIN_LEAD_STEPS`; the eligible one with the lowest median relative error on tune
    is chosen (ties: the longer median lead, then the grid's order), and only then is its error on
    the test runs computed.
    """
    scored = []
    for rule in FORECAST_GRID:
        rows = forecast_errors(tune, {"c": {"rule": rule}}, collapse)
        crossed = [x for x in rows if x["relative_error"] is not None]
        leads = [x["actual"] - x["fired"] for x in crossed]
        every_run = {x["run"] for x in crossed} == {d.run.name for d in tune}
        lead = statistics.median(leads) if leads else None
        eligible = bool(tune) and every_run and lead is not None and lead >= FORECAST_MIN_LEAD_STEPS
        scored.append(
            {
                "rule": rule,
                "tune_forecasts": len(rows),
                "tune_crossed": len(crossed),
                "tune_median_lead_steps": lead,
                "tune_median": statistics.median(x["relative_error"] for x in crossed) if crossed else None,
                "eligible": eligible,
            }
        )
    eligible = [c for c in scored if c["eligible"]]
    if not eligible:
        return {"candidates": scored, "chosen": None, "test": [], "min_lead_steps": FORECAST_MIN_LEAD_STEPS}
    best = min(enumerate(eligible), key=lambda ic: (ic[1]["tune_median"], -ic[1]["tune_median_lead_steps"], ic[0]))[1]
    test_rows = forecast_errors(test, {"c": {"rule": best["rule"]}}, collapse)
    crossed = [x for x in test_rows if x["relative_error"] is not None]
    return {
        "candidates": scored,
        "min_lead_steps": FORECAST_MIN_LEAD_STEPS,
        "tune_runs": [d.run.name for d in tune],
        "test_runs": [d.run.name for d in test],
        "chosen": best["rule"],
        "tune_median": best["tune_median"],
        "tune_median_lead_steps": best["tune_median_lead_steps"],
        "test": test_rows,
        "test_median": statistics.median(x["relative_error"] for x in crossed) if crossed else None,
        "test_median_lead_steps": statistics.median(x["actual"] - x["fired"] for x in crossed) if crossed else None,
    }


def _crossing(history: RunHistory, metric: str, op: str, threshold: float, layer: int, after: int) -> int | None:
    past = {
        ">": lambda v: v > threshold,
        ">=": lambda v: v >= threshold,
        "<": lambda v: v < threshold,
        "<=": lambda v: v <= threshold,
    }[op]
    for report in sorted(history.reports, key=lambda r: r.step):
        values = report.layers.get(metric) or []
        if report.step > after and layer < len(values) and values[layer] is not None and past(values[layer]):
            return report.step
    return None
