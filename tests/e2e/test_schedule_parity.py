"""One schedule: the agent's local entropy-floor lambdas equal the collector's for the same entropies.

The trainer applies the collector's lambdas when it answers and the agent's own when it does not
(``agent.lambdas``); both run ``contract.scheduling`` with the run's ``"schedule"`` parameters. Here
the same reports go to a real collector and into the agent's ``Lambdas``, and the two vectors must
agree to the last bit of a float, before and after the EMA has moved, including a layer that
never reported (no evidence: 0) and a NaN entropy (ignored by both).
"""

from __future__ import annotations

import math
import random

import pytest

from qkwatch.agent.lambdas.lambdas import Lambdas
from qkwatch.contract.scheduling import ScheduleConfig, entropy_floor
from tests.live import LiveCollector

N_LAYERS = 6
SCHEDULE = {"lambda_0": 5e-3, "h_star": 0.85, "beta": 0.04, "ema": 0.8}


def _entropies(rng: random.Random, step: int) -> list[float | None]:
    values: list[float | None] = [min(1.0, 0.55 + 0.08 * layer + rng.uniform(-0.05, 0.05)) for layer in range(N_LAYERS)]
    values[N_LAYERS - 1] = None  # this layer never reports an entropy
    if step == 20:
        values[1] = math.nan  # a broken measurement: ignored by both
    return values


def test_local_schedule_equals_the_collectors_for_the_same_entropies(collector: LiveCollector) -> None:
    collector.start()
    rng = random.Random(7)
    local = Lambdas(N_LAYERS, ScheduleConfig.from_mapping(SCHEDULE), sync_every=1, stale_seconds=60.0)
    with collector.client() as client:
        run = client.create_run("parity", "r", config={"n_layers": N_LAYERS, "schedule": SCHEDULE})
        for step in range(0, 60, 10):
            h = _entropies(rng, step)
            layers = {"attn_entropy": [v if v is None or math.isfinite(v) else "nan" for v in h]}
            client.send_reports(run["id"], [{"step": step, "time": 1.0e9 + step, "layers": layers}])
            local.observe({i: v for i, v in enumerate(h) if v is not None})
            served = client.lambdas(run["id"])
            assert served["lambdas"] == local.local_values(), step
            assert served["lambdas"][N_LAYERS - 1] == 0.0  # no evidence, no penalty
        assert served["schedule"]["lambda_max"] == pytest.approx(0.5)  # 100 x lambda_0 on both sides
        # and it is the closed form of the EMA'd entropies
        assert served["lambdas"][:-1] == pytest.approx(entropy_floor(served["h"][:-1], ScheduleConfig(**SCHEDULE)))
