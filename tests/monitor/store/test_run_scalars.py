"""The run scalars are read through their partial index (migration 0012), not by scanning a metric's layer values.

Under the points' key (run, metric id, head, step, layer, attempt) a metric's scalars lie one per
step among its layer values. Every read of scalars must be a range of ``ix_points_run_scalars``:
checked on the statements the store really sends (caught at the cursor), by each database's own
planner, on a run whose layer values far outnumber its scalars. And the index changes no answer.
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from qkwatch.monitor.alerting.rules import RuleSet
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import is_postgres, make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.wire import ReportBatch, RunCreate

LAYERS, STEPS = 24, 400


def _fill(store: Store, attempts: int) -> m.RunRow:
    """A run with ``qkai`` at every layer and step, and ``loss`` and ``qkai`` as scalars every 10th step."""
    project = f"scalars-{uuid.uuid4().hex[:8]}"
    for attempt in range(1, attempts + 1):
        run, _ = store.create_or_resume_run(RunCreate(project=project, name="r", attempt_key=f"a{attempt}"))
        for lo in range(0, STEPS, 50):
            reports = [
                {
                    "step": s,
                    "time": 1.0,
                    "layers": {"qkai": [(s + la) / 1000 for la in range(LAYERS)]},
                    "scalars": {"loss": 10 - s / 100 + attempt, "qkai": s / 10} if s % 10 == 0 else {},
                }
                for s in range(lo, lo + 50)
            ]
            batch = ReportBatch.model_validate({"batch_id": uuid.uuid4(), "attempt": attempt, "reports": reports})
            store.add_reports(run.id, batch, RuleSet.default())
    return store.get_run(run.id)


def _scalar_statements(store: Store, read) -> list[tuple[str, object]]:
    """The statements on ``points`` that ``read()`` sends with the run scalars' condition, and their parameters."""
    seen: list[tuple[str, object]] = []

    def note(conn, cursor, statement, parameters, context, executemany) -> None:
        if "points" in statement and m.RUN_SCALARS_WHERE.split(" AND ")[1] in statement.replace("points.", ""):
            seen.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        read()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    return seen


def _plan(engine: sa.Engine, statement: str, parameters: object) -> str:
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        if is_postgres(engine):
            cursor.execute("ANALYZE points")
            cursor.execute("EXPLAIN " + statement, parameters)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + statement, parameters)
        return "\n".join(" ".join(map(str, row)) for row in cursor.fetchall())


@pytest.mark.parametrize("attempts", [1, 2])
def test_every_read_of_the_scalars_uses_their_index(db_url: str, attempts: int):
    engine = make_engine(db_url)
    store = Store(engine)
    try:
        run = _fill(store, attempts)
        reads = {
            "history": lambda: store.history(run, ["qkai", "loss"], max_points=10**6),
            "history_doubles": lambda: store.history_doubles(run, ["qkai", "loss"], max_points=10**6),
            "series of a scalar": lambda: store.series(run, "loss", -1),
            "series of a scalar, bucketed": lambda: store.series(run, "loss", -1, max_points=5),
        }
        for name, read in reads.items():
            statements = _scalar_statements(store, read)
            assert statements, f"{name}: no statement read the scalars"
            for statement, parameters in statements:
                plan = _plan(engine, statement, parameters)
                assert "ix_points_run_scalars" in plan, f"{name}: {statement}\n{plan}"
    finally:
        store.close()


def test_the_index_changes_no_answer(db_url: str):
    """The scalars read through the index are the ones stored: every 10th step, the latest attempt's."""
    store = Store(make_engine(db_url))
    try:
        run = _fill(store, 2)
        grids = store.history(run, ["qkai", "loss"])
        loss = grids["loss"]
        assert loss.layers == [m.RUN_SCALAR]
        assert loss.steps == list(range(0, STEPS, 10))
        assert [row[0] for row in loss.values] == [10 - s / 100 + 2 for s in loss.steps]
        qkai = grids["qkai"]  # a metric with both: its scalar is layer -1 beside the layer values
        assert qkai.layers == [m.RUN_SCALAR, *range(LAYERS)]
        assert [row[0] for row in qkai.values] == [s / 10 if s % 10 == 0 else None for s in range(STEPS)]
        assert [row[1] for row in qkai.values] == [s / 1000 for s in range(STEPS)]
        series = store.series(run, "loss", -1)
        assert series.steps == loss.steps and list(series.values) == [row[0] for row in loss.values]
    finally:
        store.close()
