"""The dashboard views (migration 0004) and every SQL query of the Grafana dashboards, on real databases.

A run that collapses (layers 3-5 of 8, resumed once so that two attempts overlap) and a run that
does not are stored through the real store, alerts and all. The views must return what the
store's reads return, on SQLite and on PostgreSQL; on PostgreSQL each dashboard query, with its
template variables filled the way Grafana fills them (each variable's own query, run first), must
run as the read-only role ``qkwatch_grafana`` and return rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.dashboards.grafana.queries import iter_queries
from qkwatch.dashboards.push import POSTGRES_UID, load_dashboards
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import alembic_config, upgrade
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet
from tests.conftest import missing_service
from tests.monitor.conftest import PG_ADMIN_URL, _fresh_database, _pg_admin

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "qkwatch" / "dashboards" / "grafana"
VIEWS = ("qkwatch_runs_v", "qkwatch_points_v", "qkwatch_latest_v", "qkwatch_alerts_v", "qkwatch_events_v")
ROLE = "qkwatch_grafana"
N_LAYERS, BAND = 8, (3, 4, 5)
METRICS = ("qkai", "stable_rank", "attn_entropy", "lambda", "logit_max")
_SHIPPED = RuleSet.from_file(ROOT / "qkwatch" / "dashboards" / "rules" / "detectors.yml")
DETECTORS = dataclasses.replace(
    _SHIPPED,
    forecasts=tuple(
        dataclasses.replace(f, fit="least_squares", window=8, margin=0.0, horizon_steps=500, for_reports=2)
        for f in _SHIPPED.forecasts
    ),
)
"""The shipped candidate rules: every kind of alert, so that the alert views carry a forecast's predicted step
(the forecast a least-squares line through 8 reports, 500 steps ahead: the runs below have 13 reports)."""


# --- the data ------------------------------------------------------------------------------------


def ramp(step: int) -> float:
    """0 before step 100, 1 from step 250: how far the band has collapsed."""
    return min(1.0, max(0.0, (step - 100) / 150))


def layer_values(step: int, collapses: bool, shift: float) -> dict[str, list]:
    r = ramp(step) if collapses else 0.3 * ramp(step)
    qkai = [round((0.29 + 0.62 * r if layer in BAND else 0.25 + 0.01 * layer) + shift, 4) for layer in range(N_LAYERS)]
    if step == 50:
        qkai[7] = "nan"  # a diverged head: stored as NULL, read back as NaN
    return {
        "qkai": qkai,
        "stable_rank": [round(2.2 - 0.6 * (r if layer in BAND else 0), 4) for layer in range(N_LAYERS)],
        "attn_entropy": [round(0.6 + 0.4 * (r if layer in BAND else 0), 4) for layer in range(N_LAYERS)],
        "lambda": [round(1e-4 * (1 + 9 * r) if layer in BAND else 1e-5, 6) for layer in range(N_LAYERS)],
        "logit_max": [round(5.0 + 20.0 * (r if layer in BAND else 0), 4) for layer in range(N_LAYERS)],
    }


def report(step: int, collapses: bool, shift: float = 0.0) -> dict:
    out = {
        "step": step,
        "time": 1_800_000_000.0 + step,
        "layers": layer_values(step, collapses, shift),
        "heads": {"qkai": [[0.2 + 0.01 * h + shift, 0.3 + shift] for h in range(N_LAYERS)]},
        "scalars": {
            "loss": round(2.5 - 0.001 * step + shift, 4),
            "agent_queue_depth": 0.0,
            "agent_spool_bytes": 0.0,
            "agent_sent_total": float(step // 25),
            "agent_dead_lettered_total": 0.0,
            "agent_step_overhead_seconds": 0.002,
        },
    }
    if step == 100:
        out["events"] = [{"kind": "missing_layers", "message": "layer 7 produced no values", "data": {"layers": [7]}}]
    return out


def send(store: Store, run_id: str, reports: list[dict], attempt: int | None = None) -> None:
    for r in reports:  # one report per batch, as an agent sends them
        batch = ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "attempt": attempt, "reports": [r]})
        store.add_reports(run_id, batch, DETECTORS)


def feed(store: Store) -> dict[str, m.RunRow]:
    """Run "vanilla" (collapses; attempt 2 resumes at step 150 with other values) and run "raa" (does not)."""
    project = f"grafana-{uuid.uuid4().hex[:8]}"
    vanilla, _ = store.create_or_resume_run(
        RunCreate(
            project=project,
            name="vanilla",
            config={"n_layers": 8},
            attempt_key="first",
            tags=["vanilla", "baseline", "lr=3e-4"],
            notes="no RAA\nthe band to catch",
        )
    )
    send(store, vanilla.id, [report(s, True) for s in range(0, 225, 25)])
    store.create_or_resume_run(RunCreate(project=project, name="vanilla", attempt_key="resumed"))
    send(store, vanilla.id, [report(s, True, shift=0.01) for s in range(150, 325, 25)], attempt=2)
    raa, _ = store.create_or_resume_run(RunCreate(project=project, name="raa", config={"n_layers": 8}))
    send(store, raa.id, [report(s, False) for s in range(0, 325, 25)])
    return {"vanilla": store.get_run(vanilla.id), "raa": store.get_run(raa.id)}


# --- databases -----------------------------------------------------------------------------------


def fresh_postgres() -> Iterator[str]:
    """A new PostgreSQL database migrated to head, dropped afterwards (skips, or fails under CI, without a server)."""
    admin = _pg_admin()
    if admin is None:
        missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
    yield from _fresh_database(admin)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    yield from fresh_postgres()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def fed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(store, runs) on a migrated database holding the two runs."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('views') / 'collector.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    upgrade(engine)
    store = Store(engine)
    try:
        yield store, feed(store)
    finally:
        store.close()


def rows(store: Store, query: str, **params) -> list[sa.Row]:
    with store.engine.connect() as conn:
        return conn.execute(sa.text(query), params).all()


def nan(value: float | None) -> float:
    return math.nan if value is None else value


def same(a: list, b: list) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) if isinstance(x, float) and math.isnan(x) else x == y
        for x, y in zip(a, b, strict=True)
    )


# --- the views -----------------------------------------------------------------------------------


def test_points_view_is_the_stores_series(fed):
    store, runs = fed
    for run in runs.values():
        for metric, layer, head in [
            *((mt, la, -1) for mt in METRICS for la in range(N_LAYERS)),
            ("loss", -1, -1),
            ("agent_sent_total", -1, -1),
            ("qkai", 2, 0),
            ("qkai", 5, 1),
        ]:
            got = rows(
                store,
                "SELECT step, value FROM qkwatch_points_v WHERE run_id = :r AND metric = :m "
                "AND layer = :l AND head = :h ORDER BY step",
                r=run.id,
                m=metric,
                l=layer,
                h=head,
            )
            series = store.series(run, metric, layer, head=head)
            assert [g.step for g in got] == series.steps, (run.name, metric, layer, head)
            assert same([nan(g.value) for g in got], series.values), (run.name, metric, layer, head)


def test_points_view_merges_attempts_like_the_store(fed):
    store, runs = fed
    got = rows(
        store,
        "SELECT step, attempt, value FROM qkwatch_points_v WHERE run_id = :r AND metric = 'qkai' "
        "AND layer = 0 AND head = -1 ORDER BY step",
        r=runs["vanilla"].id,
    )
    assert [(g.step, g.attempt) for g in got] == [(s, 1 if s < 150 else 2) for s in range(0, 325, 25)]
    assert got[-1].value == pytest.approx(0.26)  # attempt 2's value (0.25 + 0.01)
    only_first = store.series(runs["vanilla"], "qkai", 0, attempt=1)
    assert only_first.steps == list(range(0, 225, 25))  # the overlapped steps are still stored


def test_points_view_is_the_stores_heatmap(fed):
    store, runs = fed
    for run in runs.values():
        for metric in METRICS:
            heat = store.heatmap(run, metric, max_steps=10**6)
            got = rows(
                store,
                "SELECT step, layer, value FROM qkwatch_points_v WHERE run_id = :r AND metric = :m "
                "AND head = -1 AND layer >= 0",
                r=run.id,
                m=metric,
            )
            grid = {(g.step, g.layer): nan(g.value) for g in got}
            assert sorted({s for s, _ in grid}) == heat.steps and sorted({la for _, la in grid}) == heat.layers
            for i, step in enumerate(heat.steps):
                assert same([grid[(step, la)] for la in heat.layers], heat.values[i]), (run.name, metric, step)


def test_runs_latest_alerts_and_events_views_are_the_stores(fed):
    store, runs = fed
    listed, _ = store.list_runs(projects=[runs["vanilla"].project])
    got = rows(store, "SELECT * FROM qkwatch_runs_v WHERE project = :p", p=runs["vanilla"].project)
    assert {
        (g.run_id, g.run_name, g.status, g.status_reason, g.attempt, g.last_step, g.last_report_at) for g in got
    } == {(r.id, r.name, r.status, r.status_reason, r.latest_attempt, r.last_step, r.last_report_at) for r in listed}
    assert {(g.run_id, g.tags, g.notes) for g in got} == {(r.id, ",".join(r.tags) or None, r.notes) for r in listed}
    assert runs["vanilla"].tags == ("baseline", "lr=3e-4", "vanilla") and runs["raa"].tags == ()
    _, latest = store.latest_snapshot(["qkai", "loss"], max_runs=1000, max_layers=1000)
    mine = {(r.run_id, r.metric, r.layer): (r.step, r.value) for r in latest if r.project == runs["vanilla"].project}
    got = rows(
        store,
        "SELECT run_id, metric, layer, step, value FROM qkwatch_latest_v WHERE project = :p "
        "AND metric IN ('qkai', 'loss')",
        p=runs["vanilla"].project,
    )
    assert {(g.run_id, g.metric, g.layer): (g.step, nan(g.value)) for g in got} == mine
    for run in runs.values():
        alerts = store.list_alerts(projects=None, run_id=run.id)
        got = rows(
            store,
            "SELECT alert_id, rule, state, layers, onset_step, predicted_step, summary FROM qkwatch_alerts_v "
            "WHERE run_id = :r",
            r=run.id,
        )
        assert sorted(
            (g.alert_id, g.rule, g.state, json.loads(g.layers), g.onset_step, g.predicted_step, g.summary) for g in got
        ) == sorted((a.id, a.rule, a.state, a.layers, a.onset_step, a.predicted_step, a.summary) for a in alerts)
        events = store.list_events(run)
        got = rows(
            store, "SELECT step, kind, message, time FROM qkwatch_events_v WHERE run_id = :r ORDER BY step", r=run.id
        )
        assert [tuple(g) for g in got] == [(e.step, e.kind, e.message, e.time) for e in events]
    assert {a.rule for a in store.list_alerts(projects=None, run_id=runs["vanilla"].id)} == {
        "qkai_high",
        "collapse_band",
        "attn_uniform",
        "logit_growth",
    }
    forecasts = store.list_alerts(projects=None, run_id=runs["raa"].id)  # its band drifts up, slowly
    assert {(a.rule, a.predicted_step) for a in forecasts} == {("qkai_forecast", 504)}


def test_the_alerts_view_carries_an_ended_alerts_end_and_last_values(scratch_url: str):
    """A run that finishes while its band collapses: the view says "ended", where, how and with which values,
    as the store does (migration 0008's columns)."""
    store = Store(make_engine(scratch_url))
    try:
        run, _ = store.create_or_resume_run(RunCreate(project="p", name="ends-collapsed", config={"n_layers": 8}))
        send(store, run.id, [report(s, True) for s in range(0, 325, 25)])
        store.set_status(run.id, "finished")
        alerts = {a.id: a for a in store.list_alerts(projects=None, run_id=run.id)}
        got = rows(
            store,
            "SELECT alert_id, state, resolved_step, ended_step, run_end, last_values FROM qkwatch_alerts_v "
            "WHERE run_id = :r",
            r=run.id,
        )
        ended = [g for g in got if g.state == "ended"]
        assert ended and len(got) == len(alerts)
        for g in got:
            a = alerts[g.alert_id]
            last = json.loads(g.last_values) if g.last_values else None
            assert (g.state, g.resolved_step, g.ended_step, g.run_end, last) == (
                a.state,
                a.resolved_step,
                a.ended_step,
                a.run_end,
                a["last_values"],  # as the API sends them: wire values, like the view's JSON
            )
        for g in ended:
            assert (g.ended_step, g.run_end) == (300, "finished") and g.resolved_step is None
        band = [alerts[g.alert_id] for g in ended if alerts[g.alert_id].rule == "collapse_band"]
        assert [a.last_values for a in band] == [[0.91, 0.91, 0.91]]  # 0.29 + 0.62 at full collapse
    finally:
        store.close()


# --- migration and role --------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def scratch_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of its own, migrated to head (this test migrates it down and up)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'scratch.db'}"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
        return
    yield from fresh_postgres()


def view_names(engine: sa.Engine) -> set[str]:
    return {v for v in sa.inspect(engine).get_view_names() if v.startswith("qkwatch_")}


def test_downgrade_drops_the_views_and_upgrade_restores_them(scratch_url: str):
    engine = make_engine(scratch_url)
    try:
        assert view_names(engine) == set(VIEWS)
        cfg = alembic_config()
        with engine.connect().execution_options(write=True) as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0003")
            conn.commit()
        engine.dispose()
        assert view_names(engine) == set()
        upgrade(engine)
        engine.dispose()
        assert view_names(engine) == set(VIEWS)
        if engine.dialect.name == "postgresql":
            assert_role_reads_only_the_views(engine)
    finally:
        engine.dispose()


def assert_role_reads_only_the_views(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        for view in VIEWS:
            assert conn.execute(sa.text(f"SELECT has_table_privilege('{ROLE}', '{view}', 'SELECT')")).scalar(), view
        tables = sa.inspect(conn).get_table_names()
        assert "points" in tables
        for table in tables:
            for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE"):
                assert not conn.execute(
                    sa.text(f"SELECT has_table_privilege('{ROLE}', '{table}', '{privilege}')")
                ).scalar(), (table, privilege)


def test_grafana_role_reads_the_views_and_nothing_else(pg_url: str):
    engine = make_engine(pg_url)
    try:
        assert_role_reads_only_the_views(engine)
        with engine.connect() as conn:
            conn.execute(sa.text(f"SET ROLE {ROLE}"))
            conn.execute(sa.text("SELECT count(*) FROM qkwatch_points_v")).scalar()
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                conn.execute(sa.text("SELECT count(*) FROM points"))
    finally:
        engine.dispose()


# --- every dashboard query -----------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)\]\]")


def expand(text: str, values: dict[str, tuple[str, str]]) -> str:
    """Grafana's interpolation of single-value variables: ``$v``, ``${v}``, ``${v:text}``, ``[[v]]``."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(3) or match.group(4)
        if name.startswith("__"):
            raise AssertionError(f"a Grafana macro or built-in ({name}) in a SQL query: the tests cannot expand it")
        label, value = values[name]
        return label if match.group(2) == "text" else value.replace("'", "''")

    return VARIABLE.sub(one, text)


def resolve_variables(conn: sa.Connection, board: dict, choose: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each variable's (text, value), in order, from its own query: the option ``choose`` names, else the first."""
    values: dict[str, tuple[str, str]] = {}
    for var in board["templating"]["list"]:
        if var["type"] == "custom":
            values[var["name"]] = (var["current"]["text"], var["current"]["value"])
            continue
        found = conn.execute(sa.text(expand(var["query"], values))).mappings().all()
        options = [(str(r.get("__text", v)), str(v)) for r in found for v in [r.get("__value", next(iter(r.values())))]]
        assert options, f"{board['title']}: variable {var['name']} has no values"
        wanted = choose.get(var["name"], options[0][1])
        (values[var["name"]],) = [o for o in options if o[1] == wanted]
    return values


@pytest.fixture(scope="module")
def grafana_db() -> Iterator[tuple[Store, dict[str, m.RunRow]]]:
    """A PostgreSQL database holding only the two runs."""
    for url in fresh_postgres():
        store = Store(make_engine(url))
        try:
            yield store, feed(store)
        finally:
            store.close()


@pytest.mark.parametrize("board", load_dashboards(GRAFANA / "dashboards"), ids=lambda b: b["uid"])
def test_every_sql_query_runs_as_the_grafana_role_and_returns_rows(grafana_db, board):
    store, runs = grafana_db
    queries = [(where, text) for where, uid, text in iter_queries(board) if uid == POSTGRES_UID]
    assert len(queries) >= 8
    with store.engine.connect() as conn:
        conn.execute(sa.text(f"SET ROLE {ROLE}"))
        # The run variables list both runs; the collapsing run is the one with alerts to show.
        values = resolve_variables(
            conn, board, {"run": runs["vanilla"].id, "run_a": runs["vanilla"].id, "run_b": runs["raa"].id}
        )
        for where, text in queries:
            found = conn.execute(sa.text(expand(text, values))).all()
            assert found, f"{board['title']}, {where}: no rows for\n{expand(text, values)}"
    if board["uid"] == "qkwatch-runs":
        assert values["run_a"][0] == f"{runs['vanilla'].project} / vanilla"


def test_the_band_heatmap_query_is_the_stores_heatmap(grafana_db):
    """The run dashboard's QKAI table heatmap: the store's heatmap bucketed to $columns steps, by max."""
    store, runs = grafana_db
    (board,) = [b for b in load_dashboards(GRAFANA / "dashboards") if b["uid"] == "qkwatch-run"]
    (panel,) = [p for p in board["panels"] if p["title"].startswith("QKAI per layer and step")]
    assert panel["transformations"][0]["id"] == "groupingToMatrix"
    run = runs["vanilla"]
    for columns in ("5", "40"):
        text = expand(panel["targets"][0]["rawSql"], {"run": ("", run.id), "columns": (columns, columns)})
        got = {(r.step, r.layer): nan(r.value) for r in rows(store, text)}
        heat = store.heatmap(run, "qkai", max_steps=int(columns))
        want = {
            (step, f"layer {la}"): v
            for step, vals in zip(heat.steps, heat.values, strict=True)
            for la, v in zip(heat.layers, vals, strict=True)
        }
        assert got.keys() == want.keys()
        assert same([got[k] for k in sorted(got)], [want[k] for k in sorted(want)])
    top = {layer: v for (step, layer), v in got.items() if step == max(s for s, _ in got)}
    assert {la for la, v in top.items() if v > 0.70} == {f"layer {la}" for la in BAND}
