"""Every value given to ``Agent.log`` is stored at the step it was logged, exactly once.

Reports come every ``every`` steps; a loss logged at every step must not be thinned to one in
``every`` (a divergence shows in the steps between reports). Values logged between reports ride
with the next report's single copy to the host and become scalar-only reports of their own steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.agent import MAX_LOGGED_STEPS
from qkwatch.agent.shipping.disk_spool import SpoolConfig
from qkwatch.contract.wire import Report
from tests.agent.tiny import TinyGPT, train
from tests.live import LiveCollector

FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}


def spooled(spool: Path) -> list[dict]:
    """Every report the agent spooled (nothing delivered: it ran offline), in spool order."""
    (rank,) = spool.glob("*/*/rank-0")
    s = SpoolConfig().open(rank)
    try:
        return [r.payload["report"] for r in s.pending(100_000) if "report" in r.payload]
    finally:
        s.close()


@pytest.mark.slow
def test_sixty_logged_losses_give_sixty_stored_points(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(model, url=collector.url, project="tests", run="every", spool=str(tmp_path), every=10, **FAST)
    train(a, model, 60)
    for step in range(60):  # a host float at every step too, as a trainer logs its lr
        a.log(step, lr=1e-3 * (step + 1))
    a.close(timeout=60)
    with collector.client() as c:
        loss = c.series("tests/every", "loss")
        lr = c.series("tests/every", "lr")
        qkai = c.series("tests/every", "qkai", layer=0)
        history = c.history("tests/every", metrics=["loss"], frame=False)
    assert list(loss.steps) == list(range(60)) and all(math.isfinite(v) for v in loss.values)
    assert list(lr.steps) == list(range(60)) and lr.values == pytest.approx([1e-3 * (s + 1) for s in range(60)])
    assert list(qkai.steps) == list(range(0, 60, 10))  # the layer metrics keep their cadence
    rows = [s for s, v in zip(history["step"], history["loss"], strict=True) if v is not None]
    assert rows == list(range(60))


def test_each_value_is_stored_at_its_own_step_with_its_own_value(tmp_path: Path) -> None:
    model = TinyGPT()
    a = agent.attach(model, url=None, project="tests", run="steps", spool=str(tmp_path), every=10, **FAST)
    for step in range(25):
        a.step(step)
        model(torch.randint(0, 64, (2, 16)))
        a.log(step, loss=torch.tensor(float(step)), lr=0.5 * step)
    a.close(timeout=1)
    reports = spooled(tmp_path)
    by_step: dict[int, dict] = {}
    for r in reports:
        for name, value in r["scalars"].items():
            assert (r["step"], name) not in {(s, n) for s, d in by_step.items() for n in d}, "stored twice"
            by_step.setdefault(r["step"], {})[name] = value
    assert sorted(by_step) == list(range(25))
    assert all(by_step[s]["loss"] == float(s) and by_step[s]["lr"] == 0.5 * s for s in range(25))
    full = {r["step"] for r in reports if r["layers"]}
    assert full == {0, 10, 20}  # report steps carry their loss inside the report itself
    assert all("loss" in r["scalars"] for r in reports if r["step"] in full)


def test_logged_steps_ship_on_their_own_when_no_report_comes(tmp_path: Path) -> None:
    model = TinyGPT()
    a = agent.attach(model, url=None, project="tests", run="long", spool=str(tmp_path), every=100_000, **FAST)
    for step in range(MAX_LOGGED_STEPS + 40):
        a.step(step)
        a.log(step, loss=torch.tensor(1.0 / (step + 1)))
    waiting = len(a._logged)
    before_close = {r.payload["report"]["step"] for r in a.spool.pending(100_000) if "report" in r.payload}
    a.spool.release()
    a.close(timeout=1)
    after_close = [r["step"] for r in spooled(tmp_path) if "loss" in r["scalars"]]
    assert waiting < MAX_LOGGED_STEPS  # bounded: what waits never reaches the bound
    assert len(before_close) >= MAX_LOGGED_STEPS - 1
    assert sorted(after_close) == list(range(MAX_LOGGED_STEPS + 40))


def test_a_name_the_collector_would_refuse_is_cleaned_not_sent_to_sink_the_batch(tmp_path: Path, caplog) -> None:
    model = TinyGPT()
    a = agent.attach(model, url=None, project="tests", run="names", spool=str(tmp_path), every=1, **FAST)
    a.step(0)
    model(torch.randint(0, 64, (2, 16)))
    a.log(0, **{"val top-1 acc": 0.5, "eval/loss": 1.0})
    a.log_layers(0, {"my metric": [1.0] * 4})
    a.close(timeout=1)
    (report,) = [r for r in spooled(tmp_path) if r["step"] == 0]
    assert report["scalars"]["val_top-1_acc"] == 0.5 and report["scalars"]["eval/loss"] == 1.0
    assert "my_metric" in report["layers"]
    assert Report.model_validate(report)  # the collector's own schema accepts the report
    assert sum("is stored as 'val_top-1_acc'" in r.getMessage() for r in caplog.records) == 1
