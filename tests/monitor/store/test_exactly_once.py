"""Property: any replay of any subset of batches, in any order, stores exactly their union."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet
from tests.monitor.store.plans import plan_of, statements

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


def test_a_partial_replay_reads_only_its_own_steps_of_the_points(isolated_db_url: str):
    """A batch holding points stored already reads their first values back (``keep_first_values``).
    However its database plans that read, with statistics or without (a fresh database has none),
    it may touch only the batch's own steps of the points, not the run's whole range of the key:
    found at 256 ranks in bench/fleet.py, where PostgreSQL scanned every point of the run for each
    replayed batch. Checked on the statement the store sends, by the database's plan of it."""
    engine = make_engine(isolated_db_url)
    store = Store(engine)
    layers, metrics = 24, [f"m{i}" for i in range(6)]
    try:
        run, _ = store.create_or_resume_run(RunCreate(project=f"replay-{uuid.uuid4().hex[:6]}", name="r"))

        def batch(steps: range) -> ReportBatch:
            reports = [
                {"step": s, "time": 1.0, "layers": {name: [s / 1000 + la for la in range(layers)] for name in metrics}}
                for s in steps
            ]
            return ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports})

        for lo in range(0, 400, 50):
            store.add_reports(run.id, batch(range(lo, lo + 50)), RuleSet.default())
        replay = batch(range(200, 210))  # a new id, old points
        result, seen = statements(
            engine,
            lambda statement: statement.startswith("WITH k (metric_id, layer, step)"),
            lambda: store.add_reports(run.id, replay, RuleSet.default()),
        )
        assert (result.inserted, result.duplicates) == (0, 10 * layers * len(metrics))
        assert seen, "the replay did not read the stored values"
        for statement, parameters in seen:
            plan = plan_of(engine, statement, parameters, analyze=True)
            # PostgreSQL: each index scan's condition; SQLite: each SEARCH or SCAN of the points (alias p).
            conditions = [
                line for line in plan.splitlines() if "Index Cond" in line or " p USING" in line or "SCAN p" in line
            ]
            assert conditions and all("step" in line for line in conditions), plan
            assert "Seq Scan on points" not in plan, plan
    finally:
        store.close()
