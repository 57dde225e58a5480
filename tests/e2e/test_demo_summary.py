"""The demo's last lines against a real ``qkwatch serve``: when the vanilla run finishes with its band still
collapsed, its progress line and the closing table keep the ALERT tag (its alerts ended with the run while
firing; nothing resolved them), and the RAA run, which never fired, has none. The whole demo is
``test_demo.py`` (slow); this is its summary on runs made to order, in seconds."""

from __future__ import annotations

import re

from qkwatch.demo.readout import progress_line, summary_table
from tests.live import LiveCollector
from tests.monitor.ui.runs import BAND, STEPS, seed


def test_an_alert_firing_when_the_run_ended_is_still_tagged_alert(collector: LiveCollector) -> None:
    collector.start()
    with collector.client() as client:
        vanilla, raa = seed(client)
        for run in (vanilla, raa):
            client.set_status(run["id"], "finished")
        assert client.alerts(run=vanilla["id"], state="firing")["count"] == 0  # the run ended: nothing fires now
        line = progress_line(client, "vanilla", vanilla["id"], list(BAND))
        assert line.endswith("ALERT collapse_band (run ended while firing), qkai_high (run ended while firing)"), line
        assert "ALERT" not in progress_line(client, "raa", raa["id"], list(BAND))
        table = summary_table(client, {"vanilla": vanilla["id"], "raa": raa["id"]}, list(BAND), 150)
    assert re.search(r"still firing at the end\s+ALERT collapse_band, qkai_high\s+none\n", table), table
    assert re.search(r"alerts that fired\s+collapse_band, qkai_high\s+none\n", table), table
    assert re.search(r"status\s+finished\s+finished\n", table), table
    assert re.search(rf"vanilla: step\s+{STEPS[-1]}\s+band QKAI", line), line
