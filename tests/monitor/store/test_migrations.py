"""Migrations: the tables they make are the models', on both databases, and upgrades keep the data."""

from __future__ import annotations

import uuid
from array import array

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import alembic_config, upgrade
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet


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
            for step, value in ((0, 0.25), (1, 0.5)):  # a point and its frame, as the collector writes them
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
                        "VALUES (:pk, 'qkai', :step, 1, 'a1', :vals, NULL, :f)"
                    ),
                    {"pk": pk, "step": step, "vals": array("d", [value]).tobytes(), "f": False},
                )
        upgrade(engine)
        store = Store(engine)
        run = store.list_runs(projects=["p"])[0][0]
        assert store.series(run, "qkai", 0).values == [0.25, 0.5]
        assert store.heatmap(run, "qkai").values == [[0.25], [0.5]]
        assert [(r[1], r[5]) for r in store.export_rows(run)] == [(0, 0.25), (1, 0.5)]  # the points
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
        store = Store(engine)  # the store of the head revision: it writes the run and its report there
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        batch = {"batch_id": str(uuid.uuid4()), "reports": [{"step": 100, "time": 0.0, "layers": {"qkai": [0.1, 0.2]}}]}
        store.add_reports(run.id, ReportBatch.model_validate(batch), RuleSet((), ()))  # no rules: 0004 has no memory
        _downgrade(engine, "0004")
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
        upgrade(engine, "0006")  # (0008 makes these "ended": see below)
        with engine.connect() as conn:
            rows = {r.run_pk: r for r in conn.execute(sa.text("SELECT * FROM alerts"))}
            states = conn.execute(sa.text("SELECT run_pk, layer, streak, alert_id FROM alert_state"))
            streaks = {r.run_pk: (r.streak, r.alert_id) for r in states if r.layer == 0}
        assert rows[ended.pk].state == "resolved" and rows[ended.pk].resolved_step == 20
        assert rows[ended.pk].summary.endswith("(closed: the run finished)") and rows[ended.pk].ends_at
        assert rows[live.pk].state == "firing"  # a running run's alert is left alone
        assert streaks[ended.pk] == (0, None) and streaks[live.pk][1] == rows[live.pk].id
        upgrade(engine)
        alerts = {a.run: a for a in store.list_alerts(projects=["p"], run_id=None)}
        assert (alerts[ended.id].state, alerts[ended.id].ended_step, alerts[ended.id].run_end) == (
            "ended",
            20,
            "finished",
        )
        assert alerts[live.id].state == "firing"
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
        store = Store(engine)  # the head revision's store: the run is made there
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        _downgrade(engine, "0006")
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
        upgrade(engine, "0007")
        with engine.connect() as conn:
            (memory,) = conn.execute(sa.text("SELECT memory FROM alert_state WHERE run_pk = :pk"), {"pk": run.pk}).one()
            view = conn.execute(sa.text("SELECT * FROM qkwatch_alerts_v WHERE run_id = :id"), {"id": run.id})
            row = view.mappings().one()
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_alerts_v")
        assert memory is None and row["predicted_step"] is None and list(row)[-1] == "predicted_step"
        upgrade(engine)
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


OLD_ALERT = (
    "INSERT INTO alerts (run_pk, rule, severity, state, layers, metric, summary, onset_step, resolved_step, "
    "starts_at, ends_at) "
    "VALUES (:pk, 'qkai_high', 'warning', :state, '[0]', 'qkai', :summary, 0, :resolved, 1.0, :ends)"
)


def test_alerts_the_old_code_closed_at_a_runs_end_become_ended_and_back(db_url: str):
    """0008: an alert that an ended run's close resolved (its summary ends with the note that code wrote) is
    "ended" with the step and the way the run ended, the note out of its summary, no made-up last values;
    an alert that really resolved, or fires, is left alone. The downgrade gives back exactly what was there."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)  # the head revision's store: the run is made there
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        _downgrade(engine, "0007")
        before = [
            ("resolved", "layer 0: qkai > 0.7 (0.81 at onset) (closed: the run finished)", 40, 5.0),
            ("resolved", "layer 0: qkai > 0.7 (0.82 at onset) (closed: the run crashed)", 41, 6.0),
            ("resolved", "layer 0: qkai > 0.7 (0.83 at onset) (closed: the run crashed (stale))", 42, 7.0),
            ("resolved", "layer 0: qkai back to 0.41", 43, 8.0),  # healed: stays resolved
            ("resolved", "layer 0: (closed: the run finished) is not at the end", 44, 9.0),
            ("firing", "layer 0: qkai > 0.7 (0.84 at onset)", None, None),
        ]
        with engine.begin() as conn:
            for state, summary, resolved, ends in before:
                conn.execute(
                    sa.text(OLD_ALERT),
                    {"pk": run.pk, "state": state, "summary": summary, "resolved": resolved, "ends": ends},
                )
        upgrade(engine)
        got = sorted(store.list_alerts(projects=["p"], run_id=run.id), key=lambda a: a.id)
        assert [
            (a.state, a.summary, a.resolved_step, a.ended_step, a.run_end, a.last_values, a.ends_at_s) for a in got
        ] == [
            ("ended", "layer 0: qkai > 0.7 (0.81 at onset)", None, 40, "finished", None, 5.0),
            ("ended", "layer 0: qkai > 0.7 (0.82 at onset)", None, 41, "crashed", None, 6.0),
            ("ended", "layer 0: qkai > 0.7 (0.83 at onset)", None, 42, "stale", None, 7.0),
            ("resolved", "layer 0: qkai back to 0.41", 43, None, None, None, 8.0),
            ("resolved", "layer 0: (closed: the run finished) is not at the end", 44, None, None, None, 9.0),
            ("firing", "layer 0: qkai > 0.7 (0.84 at onset)", None, None, None, None, None),
        ]
        with engine.connect() as conn:
            view = conn.execute(sa.text("SELECT * FROM qkwatch_alerts_v WHERE run_id = :id"), {"id": run.id})
            assert list(view.keys())[-4:] == ["predicted_step", "ended_step", "run_end", "last_values"]
            assert sorted((r.state, r.ended_step, r.run_end) for r in view) == sorted(
                (a.state, a.ended_step, a.run_end) for a in got
            )
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_alerts_v")

        _downgrade(engine, "0007")
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT state, summary, resolved_step, ends_at FROM alerts ORDER BY id")).all()
            assert "ended_step" not in columns(conn, sa.text("SELECT * FROM qkwatch_alerts_v"))
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_alerts_v")
        assert [tuple(r) for r in rows] == before
        upgrade(engine)
    finally:
        engine.dispose()


def test_the_downgrade_of_an_alert_ended_by_the_collector_restarts_its_rule(db_url: str):
    """An alert the collector ended (its rule still holding it firing) goes back to what the old code wrote:
    resolved at the run's last step with the note, and its rule's streak started over."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"r-{uuid.uuid4().hex[:6]}"))
        reports = [{"step": s, "time": 0.0, "layers": {"qkai": [0.9]}} for s in (0, 10, 20)]
        batch = ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": reports})
        store.add_reports(run.id, batch, RuleSet.default())
        store.set_status(run.id, "crashed", reason="stale")
        [alert] = store.list_alerts(projects=["p"], run_id=run.id)
        assert (alert.state, alert.run_end, alert.last_values) == ("ended", "stale", [0.9])
        _downgrade(engine, "0007")
        with engine.connect() as conn:
            a = conn.execute(sa.text("SELECT state, summary, resolved_step FROM alerts WHERE id = :i"), {"i": alert.id})
            assert tuple(a.one()) == ("resolved", alert.summary + " (closed: the run crashed (stale))", 20)
            state = conn.execute(
                sa.text("SELECT streak, alert_id FROM alert_state WHERE run_pk = :pk AND rule = 'qkai_high'"),
                {"pk": run.pk},
            )
            assert tuple(state.one()) == (0, None)
        upgrade(engine)
    finally:
        engine.dispose()


def test_tags_and_notes_arrive_on_existing_runs_and_leave_cleanly(db_url: str):
    """0009: runs stored before it get no tags and no notes; tags and notes are stored and searched, and shown
    in qkwatch_runs_v (its last columns, the Grafana role still reads it); the downgrade drops the table, the
    column and the view's columns, keeps the runs and every other view, and a second upgrade works."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)
        tagged, _ = store.create_or_resume_run(
            RunCreate(project="p", name=f"t-{uuid.uuid4().hex[:6]}", tags=["lr=3e-4", "baseline"], notes="why\nhow")
        )
        _downgrade(engine, "0008")
        with engine.begin() as conn:
            assert "notes" not in columns(conn, sa.text("SELECT * FROM runs"))
            assert "run_tags" not in sa.inspect(conn).get_table_names()
            assert columns(conn, sa.text("SELECT * FROM qkwatch_runs_v"))[-1] == "last_report_at"
            views = {v for v in sa.inspect(conn).get_view_names() if v.startswith("qkwatch_")}
            assert len(views) == 5
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_runs_v")
            old = f"old-{uuid.uuid4().hex[:6]}"  # a run as 0008's code wrote it
            conn.execute(
                sa.text(
                    "INSERT INTO runs (id, project, name, status, config, created_at, updated_at, "
                    "latest_attempt, lambda_version) VALUES (:id, 'p', :name, 'running', '{}', 0, 0, 1, 0)"
                ),
                {"id": uuid.uuid4().hex, "name": old},
            )
        upgrade(engine)
        assert {v for v in sa.inspect(engine).get_view_names() if v.startswith("qkwatch_")} == views
        came_back = store.get_run(tagged.id)
        assert (came_back.tags, came_back.notes) == ((), None)  # the downgrade dropped them
        before = store.get_run_by_name("p", old)
        assert (before.tags, before.notes) == ((), None)
        store.create_or_resume_run(RunCreate(project="p", name=old, tags=["sweep/a", "baseline"], notes="later"))
        found, count = store.search_runs(projects=["p"], tags=["baseline", "sweep/a"])
        assert count == 1 and [(r.name, r.tags, r.notes) for r in found] == [(old, ("baseline", "sweep/a"), "later")]
        with engine.connect() as conn:
            view = conn.execute(sa.text("SELECT * FROM qkwatch_runs_v WHERE run_name = :n"), {"n": old})
            row = view.mappings().one()
            assert list(row)[-2:] == ["tags", "notes"] and (row["tags"], row["notes"]) == ("baseline,sweep/a", "later")
            empty = conn.execute(sa.text("SELECT tags, notes FROM qkwatch_runs_v WHERE run_id = :i"), {"i": tagged.id})
            assert tuple(empty.one()) == (None, None)
            query = "SELECT run_pk FROM run_tags WHERE tag = 'baseline'"  # a search by tag: an index range
            if engine.dialect.name == "postgresql":
                assert _grafana_may_read(conn, "qkwatch_runs_v")
                conn.execute(sa.text("SET enable_seqscan = off"))  # a table this small is read whole otherwise
                plan = " ".join(conn.execute(sa.text(f"EXPLAIN {query}")).scalars())
            else:
                plan = " ".join(str(r[-1]) for r in conn.execute(sa.text(f"EXPLAIN QUERY PLAN {query}")))
            assert "ix_run_tags_tag" in plan, plan
    finally:
        engine.dispose()


def test_run_metrics_arrive_filled_and_names_no_run_uses_go(db_url: str):
    """0010: run_metrics is filled from the points and frames stored; the names no run uses (a deleted
    run's: before 0010 none was ever deleted) and the points and frames under an id without a name (what
    a collector with a stale id cache wrote into a re-created database, issue 21 H1) are deleted; what
    runs use is kept; the downgrade drops the table and a second upgrade works."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)
        run, _ = store.create_or_resume_run(RunCreate(project="p", name=f"n-{uuid.uuid4().hex[:6]}"))
        report = {"step": 0, "time": 0.0, "layers": {"qkai": [0.1, 0.2]}, "scalars": {"loss": 2.5}}
        store.add_reports(
            run.id, ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": [report]}), RuleSet((), ())
        )
        _downgrade(engine, "0009")
        with engine.begin() as conn:  # what 0009's collector could leave behind
            conn.execute(sa.text("INSERT INTO metric_names (name) VALUES ('of_a_deleted_run')"))
            nameless = {"pk": run.pk, "m": 999, "vals": array("d", [0.7]).tobytes(), "f": False}
            conn.execute(
                sa.text(
                    "INSERT INTO points (run_pk, metric_id, head, layer, step, attempt, value) "
                    "VALUES (:pk, :m, -1, 0, 5, 1, 0.7)"
                ),
                nameless,
            )
            conn.execute(
                sa.text(
                    "INSERT INTO frames (run_pk, metric_id, step, attempt, mask, vals, present, has_nan) "
                    "VALUES (:pk, :m, 5, 1, 'a1', :vals, NULL, :f)"
                ),
                nameless,
            )
        upgrade(engine)
        with engine.connect() as conn:
            ids = dict(conn.execute(sa.text("SELECT name, id FROM metric_names")).all())
            assert set(ids) == {"qkai", "loss"}
            used = set(conn.execute(sa.text("SELECT run_pk, metric_id FROM run_metrics")).all())
            assert used == {(run.pk, ids["qkai"]), (run.pk, ids["loss"])}
            for table in ("points", "frames"):
                assert conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE metric_id = 999")).scalar() == 0
        assert [store.series(run, "qkai", la).values for la in range(2)] == [[0.1], [0.2]]
        assert store.series(run, "loss", -1).values == [2.5]
        _downgrade(engine, "0009")
        assert "run_metrics" not in sa.inspect(engine).get_table_names()
        upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM run_metrics")).scalar() == 2
    finally:
        engine.dispose()


def test_points_key_puts_the_step_before_the_layer_and_keeps_every_point(db_url: str):
    """0011: the points' primary key is (run, metric id, head, step, layer, attempt); its downgrade
    brings back (..., layer, step, ...); both keep every point and the views that read them."""
    engine = make_engine(db_url)
    try:
        upgrade(engine)
        store = Store(engine)
        run, _ = store.create_or_resume_run(RunCreate(project=f"rekey-{uuid.uuid4().hex[:6]}", name="r"))
        reports = [{"step": s, "time": 1.0, "layers": {"qkai": [s / 10, "nan"]}} for s in range(3)]
        store.add_reports(
            run.id, ReportBatch.model_validate({"batch_id": uuid.uuid4(), "reports": reports}), RuleSet.default()
        )
        before = sorted(store.export_rows(run), key=repr)

        def key() -> list[str]:
            return sa.inspect(engine).get_pk_constraint("points")["constrained_columns"]

        assert key() == ["run_pk", "metric_id", "head", "step", "layer", "attempt"]
        _downgrade(engine, "0010")
        assert key() == ["run_pk", "metric_id", "head", "layer", "step", "attempt"]
        upgrade(engine)
        assert key() == ["run_pk", "metric_id", "head", "step", "layer", "attempt"]
        assert sorted(store.export_rows(run), key=repr) == before
        with engine.connect() as conn:  # the dashboards' view still reads the table
            n = conn.execute(sa.text("SELECT count(*) FROM qkwatch_points_v WHERE run_id = :id"), {"id": run.id})
            assert n.scalar() == 6
    finally:
        engine.dispose()
