"""Red team, kill -9 (issue 34): a real collector killed with SIGKILL in the middle of a real agent's
stream of dense scalars (the loss of every step, a report every 5), on SQLite and on PostgreSQL.

The agent trains on through the outage (its spool keeps everything), the collector restarts over
the same database, and the agent's close delivers the rest. What the collector exports is then
every step's loss exactly once, every report's layers exactly once, nothing twice, nothing lost.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from qkwatch import agent
from qkwatch.launch import CollectorProcess
from tests.agent.tiny import TinyGPT, train

pytestmark = pytest.mark.slow

STEPS, EVERY, LAYERS = 60, 5, 4


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    return isolated_db_url


def test_sigkill_of_the_collector_mid_stream_loses_nothing_and_stores_nothing_twice(
    db_url: str, tmp_path: Path
) -> None:
    collector = CollectorProcess(db_url, log=tmp_path / "collector.log", open_access=True, own_group=True)
    collector.start()
    try:
        torch.manual_seed(0)
        model = TinyGPT()
        fast = {"spectra_every": 0, "flush_seconds": 0.02, "backoff_base": 0.05, "backoff_cap": 0.3}
        a = agent.attach(
            model, url=collector.url, project="tests", run="dense", spool=str(tmp_path / "spool"), every=EVERY, **fast
        )
        train(a, model, 20)
        time.sleep(0.3)  # batches in flight: the kill lands between a write and its answer, or in one
        collector.stop(hard=True)  # SIGKILL, the whole group: no shutdown, no flush
        train(a, model, 40, start=20)
        collector.start()
        train(a, model, STEPS, start=40)
        a.close(timeout=60)
        with collector.client() as c:
            (run,) = c.runs(project="tests", name="dense")["data"]
            rows = [json.loads(line) for line in c.export(run["id"], "jsonl") if line.strip()]
    finally:
        collector.stop()
    keys = Counter((r["attempt"], r["step"], r["metric"], r["layer"], r["head"]) for r in rows)
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1][:5]  # nothing twice
    losses = sorted(r["step"] for r in rows if r["metric"] == "loss" and r["layer"] == -1)
    assert losses == list(range(STEPS))  # every step's loss, none lost
    for layer in range(LAYERS):
        qkai = sorted(r["step"] for r in rows if r["metric"] == "qkai" and r["layer"] == layer and r["head"] == -1)
        assert qkai == list(range(0, STEPS, EVERY)), layer
