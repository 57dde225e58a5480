"""Migrations: the tables they make are the models', on both databases, and upgrades keep the data."""

from __future__ import annotations

import uuid
from array import array

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from qkwatch.monitor.alerting.rules import RuleSet
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import alembic_config, upgrade
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.wire import ReportBatch, RunCreate


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    """A database of its own: these tests migrate it from scratch, up and down."""
    return isolated_db_url


def _downgrade(engine: sa.Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.connect().execution_options(write=True) as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        conn.commit()


def test_head_matches_the_models(db_url: str):
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        upgrade(engine)  # idempotent
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), m.metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_metric_ids_migration_keeps_points_and_frames(db_url: str):
    engine = make_engine(db_url)
    try:
        _downgrade(engine, "base")
        upgrade(engine, "0001")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO runs (id, project, name, status, config, created_at, updated_at, "
                    "latest_attempt, lambda_version) VALUES (:id, 'p', 'r', 'running', '{}', 0, 0, 1, 0)"
                ),
                {"id": uuid.uuid4().hex},
            )
            pk = conn.execute(sa.text("SELECT pk FROM runs")).scalar()
            for step, value in ((0, 0.25), (1, 0.5)):
                conn.execute(
                    sa.text(
                        "INSERT INTO points (run_pk, metric, head, layer, step, attempt, value) "
                        "VALUES (:pk, 'qkai', -1, 0, :step, 1, :v)"
                    ),
                    {"pk": pk, "step": step, "v": value},
                )
            conn.execute(
                sa.text(
                    "INSERT INTO frames (run_pk, metric, step, attempt, mask, vals, present, has_nan) "
                    "VALUES (:pk, 'qkai', 0, 1, 'a1', :vals, NULL, :f)"
                ),
                {"pk": pk, "vals": array("d", [0.25]).tobytes(), "f": False},
            )
        upgrade(engine)
        store = Store(engine)
        run = store.list_runs(projects=["p"])[0][0]
        assert store.series(run, "qkai", 0).values == [0.25, 0.5]
        assert store.heatmap(run, "qkai").values == [[0.25]]
        _downgrade(engine, "0001")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM points WHERE metric = 'qkai'")).scalar() == 2
        upgrade(engine)
    finally:
        engine.dispose()


def test_frames_that_disagree_with_their_points_are_repaired(db_url: str):
    """0005: a frame stored before one value per point held on every read path is rewritten with its points' values."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        _downgrade(engine, "0004")
        store = Store(engine)
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        batch = {"batch_id": str(uuid.uuid4()), "reports": [{"step": 100, "time": 0.0, "layers": {"qkai": [0.1, 0.2]}}]}
        store.add_reports(run.id, ReportBatch.model_validate(batch), RuleSet((), ()))  # no rules: 0004 has no memory
        with engine.begin() as conn:  # what the collector stored for step 100 re-sent with three layers, before 0005
            metric_id = conn.execute(sa.text("SELECT id FROM metric_names WHERE name = 'qkai'")).scalar()
            conn.execute(
                sa.text(
                    "INSERT INTO points (run_pk, metric_id, head, layer, step, attempt, value) "
                    "VALUES (:pk, :m, -1, 2, 100, 1, 0.9)"
                ),
                {"pk": run.pk, "m": metric_id},
            )
            conn.execute(
                sa.text(
                    "INSERT INTO frames (run_pk, metric_id, step, attempt, mask, vals, present, has_nan) "
                    "VALUES (:pk, :m, 100, 1, 'a3', :vals, NULL, :f)"
                ),
                {"pk": run.pk, "m": metric_id, "vals": array("d", [0.9, 0.9, 0.9]).tobytes(), "f": False},
            )
        assert store.heatmap(run, "qkai").values == [[0.9, 0.9, 0.9]]  # the second value: the bug
        upgrade(engine)
        assert store.heatmap(run, "qkai").values == [[0.1, 0.2, 0.9]]
        assert [store.series(run, "qkai", la).values for la in range(3)] == [[0.1], [0.2], [0.9]]
    finally:
        engine.dispose()


def test_alerts_of_runs_that_had_ended_are_closed(db_url: str):
    """0006: a run that ended before the collector closed alerts at a run's end keeps none firing."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)
        ended, _ = store.create_or_resume_run(RunCreate(project="p", name=f"ended-{uuid.uuid4().hex[:6]}"))
        live, _ = store.create_or_resume_run(RunCreate(project="p", name=f"live-{uuid.uuid4().hex[:6]}"))
        for run in (ended, live):
            reports = [{"step": s, "time": 0.0, "layers": {"qkai": [0.9, 0.1]}} for s in (0, 10, 20)]
            store.add_reports(
                run.id,
                ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports}),
                RuleSet.default(),
            )
        _downgrade(engine, "0005")  # the alerts raised, back to before 0006
        with engine.begin() as conn:  # ended the old way: the status only
            conn.execute(sa.update(m.runs).where(m.runs.c.pk == ended.pk).values(status="finished"))
        upgrade(engine)
        with engine.connect() as conn:
            rows = {r.run_pk: r for r in conn.execute(sa.select(m.alerts))}
            streaks = {r.run_pk: (r.streak, r.alert_id) for r in conn.execute(sa.select(m.alert_state)) if r.layer == 0}
        assert rows[ended.pk].state == "resolved" and rows[ended.pk].resolved_step == 20
        assert rows[ended.pk].summary.endswith("(closed: the run finished)") and rows[ended.pk].ends_at
        assert rows[live.pk].state == "firing"  # a running run's alert is left alone
        assert streaks[ended.pk] == (0, None) and streaks[live.pk][1] == rows[live.pk].id
    finally:
        engine.dispose()


def columns(conn: sa.Connection, query: sa.TextClause) -> list[str]:
    return list(conn.execute(query).keys())


def _grafana_may_read(conn: sa.Connection, view: str) -> bool:
    role = "qkwatch_grafana"
    if not conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first():
        return False
    return bool(conn.execute(sa.text(f"SELECT has_table_privilege('{role}', '{view}', 'SELECT')")).scalar())


def test_rule_memory_and_predicted_step_arrive_empty_and_leave_cleanly(db_url: str):
    """0007: alert_state.memory and alerts.predicted_step (and the view's column) are added to existing rows
    as NULL; the downgrade drops them, keeps the rows, and leaves the view as 0004 made it."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        _downgrade(engine, "0006")
        store = Store(engine)
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        with engine.begin() as conn:  # an alert and its state as 0006's code wrote them
            conn.execute(
                sa.text(
                    "INSERT INTO alerts (run_pk, rule, severity, state, layers, metric, summary, onset_step, "
                    "starts_at) VALUES (:pk, 'qkai_high', 'warning', 'firing', '[0]', 'qkai', 'old', 0, 1.0)"
                ),
                {"pk": run.pk},
            )
            conn.execute(
                sa.text(
                    "INSERT INTO alert_state (run_pk, rule, layer, streak, since_step, band_layers, alert_id, "
                    "attempt, step) VALUES (:pk, 'qkai_high', 0, 3, 0, '[]', 1, 1, 20)"
                ),
                {"pk": run.pk},
            )
            assert "predicted_step" not in columns(conn, sa.text("SELECT * FROM qkwatch_alerts_v"))
        upgrade(engine)
        with engine.connect() as conn:
            (memory,) = conn.execute(sa.select(m.alert_state.c.memory).where(m.alert_state.c.run_pk == run.pk)).one()
            view = conn.execute(sa.text("SELECT * FROM qkwatch_alerts_v WHERE run_id = :id"), {"id": run.id})
            row = view.mappings().one()
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_alerts_v")
        assert memory is None and row["predicted_step"] is None and list(row)[-1] == "predicted_step"
        [alert] = store.list_alerts(projects=["p"], run_id=run.id)
        assert (alert.summary, alert.predicted_step) == ("old", None)

        with engine.begin() as conn:
            conn.execute(sa.update(m.alerts).where(m.alerts.c.run_pk == run.pk).values(predicted_step=140))
            conn.execute(sa.update(m.alert_state).values(memory='{"points":[[0,0.5]]}'))
        _downgrade(engine, "0006")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM alerts")).scalar() == 1
            assert "memory" not in columns(conn, sa.text("SELECT * FROM alert_state"))
            assert "predicted_step" not in columns(conn, sa.text("SELECT * FROM qkwatch_alerts_v"))
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_alerts_v")
        upgrade(engine)
    finally:
        engine.dispose()
