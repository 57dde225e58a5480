"""Adding a metric is one catalogue entry and one agent function, and nothing else (issue 43).

The test adds ``wq_wk_norm_ratio`` (the ratio of each head's query and key Frobenius norms) as
docs/metrics.md's "Adding a metric" says: an entry in ``qkwatch.contract.metrics`` and a function
registered with ``qkwatch.agent.metrics.weight_metric``. A tiny model trains with the agent attached
to a real collector on a loopback port (uvicorn in this process, so that it sees the same catalogue
a deployment would after the edit), and the metric must then be in the stored reports (with the
value computed independently from the model's weights), in the Prometheus exposition, offered by
the live page (headless Chromium), drawn by ``qkwatch report`` and on the Grafana run board.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from qkwatch import agent
from qkwatch.agent.metrics import summary, weight_metric
from qkwatch.client import Client
from qkwatch.client.report import write_report
from qkwatch.contract import metrics as catalogue
from qkwatch.contract.thresholds import Thresholds
from qkwatch.dashboards.grafana.boards import render
from qkwatch.monitor.main import create_app
from tests.agent.tiny import TinyGPT, train
from tests.monitor.conftest import make_settings
from tests.monitor.test_serve import free_port
from tests.monitor.ui.browser import chromium, need_chromium

NAME = "wq_wk_norm_ratio"
PROMETHEUS = "qkwatch_wq_wk_norm_ratio"


def norm_ratio(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """``(..., H, D, hs)``, ``(..., G, D, hs)`` -> ``(..., H)``: ``||Wq_h||_F / ||Wk_g(h)||_F``."""
    groups = wq.shape[-3] // wk.shape[-3]
    return wq.norm(dim=(-2, -1)) / wk.norm(dim=(-2, -1)).repeat_interleave(groups, dim=-1)


@pytest.fixture
def added() -> Iterator[None]:
    """The whole change a contributor makes: one catalogue entry, one agent function."""
    catalogue.register(
        catalogue.Metric(
            NAME,
            "Ratio of the query and key projections' Frobenius norms (mean over heads).",
            "Wq/Wk norm ratio",
            low=0.0,
            prometheus=PROMETHEUS,
            primary=True,
        )
    )
    weight_metric(NAME)(norm_ratio)
    try:
        yield
    finally:
        catalogue.CATALOGUE.pop(NAME)
        summary.REGISTERED.pop(NAME)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[str]:
    """A collector on a loopback port, in this process (no token: open access on loopback)."""
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'qkwatch.db'}", auto_migrate=True, open_access=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the collector did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_metric_added_to_the_catalogue_and_the_agent_reaches_every_view(
    added: None, collector: str, tmp_path: Path
) -> None:
    need_chromium()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(model, url=collector, project="added", run="r", spool=str(tmp_path / "spool"), every=2)
    train(a, model, 6)

    # exported to Prometheus while the run runs, per layer, with the catalogue's help text
    line = re.compile(rf'^{PROMETHEUS}\{{layer="3",project="added",run="r"\}} [0-9.e+-]+$', re.M)
    deadline = time.monotonic() + 60
    while not line.search(exposition := httpx.get(f"{collector}/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert line.search(exposition), exposition[-2000:]
    assert f"# HELP {PROMETHEUS} Ratio of the query and key projections' Frobenius norms" in exposition

    a.step(6)  # a report step: its weights are read now, the ones compared below
    a.close(timeout=30)

    # stored, with the value the weights give (the model's own c_attn rows, read independently)
    with Client(collector) as c:
        run = c.run("added/r")
        series = {layer: c.series(run, NAME, layer=layer) for layer in range(len(model.h))}
    for layer, block in enumerate(model.h):
        w = block.attn.c_attn.weight.detach().double()  # (3d, d): the rows of q, then k, then v
        d, n_head = w.shape[1], block.attn.n_head
        hs = d // n_head
        ratios = [w[h * hs : (h + 1) * hs].norm() / w[d + h * hs : d + (h + 1) * hs].norm() for h in range(n_head)]
        expected = float(sum(ratios) / n_head)
        at = dict(zip(series[layer].steps, series[layer].values, strict=True))
        assert at[6] == pytest.approx(expected, rel=1e-5), layer

    # offered by the live page
    dom = chromium(f"{collector}/?run={run.id}", tmp_path / "profile", "--dump-dom")
    assert re.search(rf'<option value="{NAME}"[^>]*title="Ratio of the query', dom), "the page does not offer it"

    # drawn by qkwatch report
    out = tmp_path / "report.html"
    write_report("added/r", out, url=collector)
    assert f'id="fig-heatmap-{NAME}-0"' in out.read_text()

    # on the Grafana run board: a trend panel titled by the entry, reading the metric's points
    board = json.loads(render(Thresholds())["dashboards/run.json"])
    (panel,) = [p for p in board["panels"] if p.get("title") == "Wq/Wk norm ratio"]
    assert f"'{NAME}'" in json.dumps(panel["targets"])
