"""Property: any replay of any subset of batches, in any order, stores exactly their union."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkwatch.monitor.alerting.rules import RuleSet
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.wire import ReportBatch, RunCreate

LAYERS = 3


def make_batches(n: int) -> list[ReportBatch]:
    """n batches whose steps overlap (batch i covers steps i..i+2), with heads and scalars."""
    batches = []
    for i in range(n):
        reports = [
            {
                "step": s,
                "time": float(s),
                "layers": {"qkai": [s / 100 + la / 10 for la in range(LAYERS)]},
                "heads": {"qkai": [[0.1, 0.2]] * LAYERS},
                "scalars": {"loss": 5.0 - s / 10},
            }
            for s in range(i, i + 3)
        ]
        batches.append(ReportBatch.model_validate({"batch_id": str(uuid.UUID(int=i + 1)), "reports": reports}))
    return batches


BATCHES = make_batches(6)


def expected_keys(indices: set[int]) -> set[tuple]:
    keys = set()
    for i in indices:
        for r in BATCHES[i].reports:
            keys |= {("qkai", -1, la, r.step) for la in range(LAYERS)}
            keys |= {("qkai", h, la, r.step) for la in range(LAYERS) for h in range(2)}
            keys.add(("loss", -1, -1, r.step))
    return keys


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.integers(0, len(BATCHES) - 1), min_size=1, max_size=14))
def test_replays_store_exactly_the_union(db_url: str, plan: list[int]):
    store = Store(make_engine(db_url))
    try:
        run, _ = store.create_or_resume_run(RunCreate(project=f"prop-{uuid.uuid4().hex[:8]}", name="r"))
        inserted = sum(store.add_reports(run.id, BATCHES[i], RuleSet.default()).inserted for i in plan)
        with store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    m.metric_names.c.name.label("metric"),
                    m.points.c.head,
                    m.points.c.layer,
                    m.points.c.step,
                    m.points.c.attempt,
                )
                .join(m.metric_names, m.metric_names.c.id == m.points.c.metric_id)
                .where(m.points.c.run_pk == run.pk)
            ).all()
        keys = [(r.metric, r.head, r.layer, r.step) for r in rows]
        assert len(keys) == len(set(keys))  # nothing twice
        assert set(keys) == expected_keys(set(plan))  # nothing missing, nothing extra
        assert inserted == len(keys)  # the counts the API returns add up
        assert {r.attempt for r in rows} == {1}
    finally:
        store.close()
