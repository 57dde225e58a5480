"""Red team, extreme series (issue 34): what the forecast, growth and threshold rules make of values at
the edges of a double, fed through the real ingest with every kind of rule on (the shipped detectors).

Per series kind a run of its own reports 1e308, -1e308, denormals (5e-324), a constant, a single
point, steps that go backwards, NaN and infinities; a healthy run reports beside them, and its QKAI
then crosses the threshold. Every batch is answered 2xx (a step already stored is a duplicate, not an
error); no alert carries a NaN or an infinity in its values or its predicted step, and its summary
reads as numbers; and the healthy run's collapse alert still fires: the evaluation carried on.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest

from qkwatch.contract.values import encode_value
from tests.monitor.conftest import Harness, report

DETECTORS = Path(__file__).resolve().parents[3] / "qkwatch" / "dashboards" / "rules" / "detectors.yml"
TINY = 5e-324
SERIES: dict[str, list[float]] = {
    "max": [1e308] * 12,
    "min": [-1e308] * 12,
    "max then min": [1e308, -1e308] * 6,
    "denormal": [TINY] * 12,
    "denormal ramp": [TINY * i for i in range(12)],
    "constant": [0.5] * 12,
    "single point": [0.9],
    "non-finite": [math.nan, math.inf, -math.inf, 1e308, math.nan, 0.5] * 2,
    "huge ramp": [1e307 * i for i in range(12)],
}
STEPS_BACKWARDS = [110, 100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 0]
METRICS = ("qkai", "stable_rank", "attn_entropy", "logit_max")


def layers(value: float) -> dict[str, list[float | str | None]]:
    """The wire's values: a non-finite one travels as "nan", "inf" or "-inf"."""
    return {m: [encode_value(value)] * 2 for m in METRICS}


@pytest.mark.parametrize("order", ["forward", "backwards"])
def test_extreme_values_answer_2xx_alert_only_in_numbers_and_never_stop_the_evaluation(
    make_harness, order: str
) -> None:
    h: Harness = make_harness(alert_rules_file=DETECTORS)
    for name, values in SERIES.items():
        run = h.create_run(f"{name.replace(' ', '-')}-{order}", {"n_layers": 2})
        steps = list(range(0, 10 * len(values), 10)) if order == "forward" else STEPS_BACKWARDS[: len(values)]
        for step, value in zip(steps, values, strict=True):  # one batch per report: each evaluated on its own
            answer = h.client.post(
                f"/v1/runs/{run['id']}/reports",
                json={"batch_id": str(uuid.uuid4()), "reports": [report(step, layers(value))]},
                headers=h.headers("ingest"),
            )
            assert answer.status_code < 300, (name, step, value, answer.status_code, answer.text[:300])
    healthy = h.create_run(f"healthy-{order}", {"n_layers": 2})
    h.send(healthy["id"], [report(s, {"qkai": [0.3, 0.95 if s >= 30 else 0.3]}) for s in range(0, 80, 10)])
    alerts = h.get("/v1/alerts", limit=10_000)["data"]
    for a in alerts:
        text = json.dumps(a)
        assert "NaN" not in text and "Infinity" not in text, a  # strict JSON: nothing non-finite in an alert
        assert "nan" not in a["summary"].lower().replace("nanogpt", ""), a["summary"]
        predicted = a.get("predicted_step")
        assert predicted is None or (isinstance(predicted, int) and abs(predicted) < 1 << 62), a
    fired = {(a["run_name"], a["rule"]) for a in alerts}
    assert (f"healthy-{order}", "qkai_high") in fired  # the loop went on for the other runs
