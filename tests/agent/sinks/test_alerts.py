"""The alerts the sinks get, judged in the agent by the collector's own rules, are the collector's
alerts: the same rules, layers, onset and resolution steps on the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkwatch import agent
from qkwatch.agent.sinks.alerts import LocalAlerts, load_rules
from qkwatch.agent.sinks.base import SinkAlert
from qkwatch.agent.sinks.tensorboard_sink import TensorBoardSink
from tests.agent.sinks.recording import Recorder, wire
from tests.agent.sinks.tensorboard_files import events
from tests.agent.sinks.test_worker import FAST
from tests.agent.tiny import TinyGPT, batch
from tests.live import LiveCollector


def qkai_at(step: int) -> list[float]:
    """Layers 1-3 above 0.70 from step 3 to 8 (a band: fires at step 5); layer 0 above it only at
    steps 3 and 4 (two reports: not enough to fire); everything calm again from step 9."""
    hot = 3 <= step <= 8
    return [0.9 if step in (3, 4) else 0.3, *([0.8 if hot else 0.4] * 3)]


def incidents(alerts: list[SinkAlert]) -> set[tuple[str, tuple[int, ...], int | None, int | None]]:
    """(rule, layers, onset, resolved step) of each alert that fired, from what a sink received."""
    resolved = {(a.rule, a.layers): a.step for a in alerts if not a.firing}
    return {(a.rule, a.layers, a.onset_step, resolved.get((a.rule, a.layers))) for a in alerts if a.firing}


def test_the_sinks_alerts_are_the_collectors(tmp_path: Path, collector: LiveCollector) -> None:
    collector.start()
    rec = Recorder()
    tb = TensorBoardSink(tmp_path / "tb")
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(
        model, url=collector.url, project="tests", run="alerts", spool=str(tmp_path / "spool"), every=1,
        sinks=[rec, tb], **FAST,
    )  # fmt: skip
    for step in range(12):
        a.step(step)
        model(batch(step)[:, :16])
        a.log_layers(step, {"qkai": qkai_at(step)})  # the report's QKAI: known, the same at both ends
    a.close(timeout=60)
    with collector.client() as c:
        stored = c.alerts(run="tests/alerts", limit=100).data
    at_collector = {(x.rule, tuple(x.layers), x.onset_step, x.resolved_step) for x in stored}
    assert at_collector == {
        ("qkai_high", (1,), 3, 9),
        ("qkai_high", (2,), 3, 9),
        ("qkai_high", (3,), 3, 9),
        ("collapse_band", (1, 2, 3), 5, 9),
    }
    assert incidents(rec.alerts) == at_collector
    assert {a.step for a in rec.alerts if a.firing} == {5}  # the third report over the threshold
    band = next(a for a in rec.alerts if a.rule == "collapse_band" and a.firing)
    assert band.severity == "critical" and band.metric == "qkai" and "1, 2, 3" in band.title
    texts = events(tmp_path / "tb").Tensors("qkwatch/alerts/text_summary")
    assert sorted(t.step for t in texts) == [5] * 4 + [9] * 4


def test_a_rules_file_replaces_the_default_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("rules:\n  - name: qkai_any\n    metric: qkai\n    op: '>'\n    for_reports: 1\n")
    monkeypatch.setenv("QKWATCH_COLLAPSE_THRESHOLD", "0.5")  # the collector's variable: a threshold left out
    local = LocalAlerts(load_rules(rules))
    fired = local.judge(wire(0, [0.4, 0.6, "nan", None]))
    assert [(x.rule, x.layers, x.firing, x.step) for x in fired] == [("qkai_any", (1,), True, 0)]
    assert local.judge(wire(0, [0.4, 0.6])) == []  # a step judged already: a replay changes nothing
    resolved = local.judge(wire(1, [0.4, 0.4]))
    assert [(x.rule, x.layers, x.firing, x.step) for x in resolved] == [("qkai_any", (1,), False, 1)]
    assert LocalAlerts(load_rules(None)).rules.thresholds[0].threshold == 0.5
