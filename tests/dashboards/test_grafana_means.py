"""Issue 21, L1, on the dashboards: the per-layer trend panels average each bucket in SQL, and
PostgreSQL's ``avg(double precision)`` raised "value out of range" on huge finite values, which
left the panel an error. Run as the Grafana role on a run whose largest logit is 1.7e308 at 2,000
steps, each trend query must answer finite means, and the ordinary run's means must stay the
store's.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.dashboards.push import load_dashboards
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet
from tests.dashboards.test_grafana_sql import GRAFANA, ROLE, expand, fresh_postgres

HUGE = 1.7e308
TREND_TITLES = ("QKAI", "Attention entropy", "Stable rank of Wq Wk^T", "RAA lambda", "Largest attention logit")


@pytest.fixture(scope="module")
def huge_run() -> Iterator[tuple[Store, m.RunRow]]:
    for url in fresh_postgres():
        store = Store(make_engine(url))
        try:
            run, _ = store.create_or_resume_run(RunCreate(project=f"huge-{uuid.uuid4().hex[:8]}", name="huge"))
            values = {"qkai": [0.5, 0.6], "stable_rank": [HUGE, 2.0], "attn_entropy": [0.7, 0.8]}
            values |= {"lambda": [1e-300, HUGE], "logit_max": [HUGE, -HUGE]}
            reports = [{"step": s, "time": float(s), "layers": values} for s in range(2000)]
            for i in range(0, len(reports), 500):
                batch = ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports[i : i + 500]})
                store.add_reports(run.id, batch, RuleSet.default())
            yield store, store.get_run(run.id)
        finally:
            store.close()


def trend_panels() -> list[dict]:
    (board,) = [b for b in load_dashboards(GRAFANA / "dashboards") if b["uid"] == "qkwatch-run"]
    found = [p for p in board["panels"] if p.get("type") == "trend"]
    assert sorted(p["title"] for p in found) == sorted(TREND_TITLES)
    return found


def test_every_trend_panel_averages_huge_values_to_finite_means(huge_run):
    store, run = huge_run
    expected = {
        "qkai": [0.5, 0.6],
        "stable_rank": [HUGE, 2.0],
        "attn_entropy": [0.7, 0.8],
        "lambda": [1e-300, HUGE],
        "logit_max": [HUGE, -HUGE],
    }
    with store.engine.connect() as conn:
        conn.execute(sa.text(f"SET ROLE {ROLE}"))
        for panel in trend_panels():
            text = expand(panel["targets"][0]["rawSql"], {"run": ("", run.id)})
            got = conn.execute(sa.text(text)).all()
            assert len(got) == 400 * 2, panel["title"]  # 2,000 steps in 400 buckets of 5, two layers
            metric = next(name for name in expected if f"metric = '{name}'" in text)
            for layer, want in enumerate(expected[metric]):
                values = [r.value for r in got if r.layer == f"layer {layer}"]
                assert all(math.isclose(v, want, rel_tol=1e-12) for v in values), (panel["title"], layer, values[:3])
