"""``qkwatch.client.Client`` against a real ``qkwatch serve`` on SQLite and on PostgreSQL: settings
from the environment, typed results with timestamps, NaN and infinities as floats, runs by
``project/name`` everywhere, run search and the whole-run history."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from qkwatch.client.rest import (
    Alert,
    AuditEntry,
    Client,
    CollectorError,
    Event,
    Page,
    Run,
    RunMetrics,
    history_columns,
    history_frame,
)
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import upgrade
from qkwatch.monitor.store.store import Store
from tests.conftest import missing_service
from tests.live import ROOT, LiveCollector, free_port
from tests.monitor.conftest import PG_ADMIN_URL, report

LAYERS = 4


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a live ``qkwatch serve --open`` on the database kind of the parameter."""
    extra: tuple[str, ...] = ()
    if request.param == "postgres":
        url = request.getfixturevalue("pg_url")
        if url is None:
            missing_service(f"PostgreSQL at {PG_ADMIN_URL}")
        extra = ("--database-url", url)  # the last --database-url wins
    live = LiveCollector(tmp_path_factory.mktemp("client"), None, *extra).start()
    try:
        yield live.url
    finally:
        live.stop()


@pytest.fixture
def c(served: str) -> Iterator[Client]:
    with Client(served) as client:
        yield client


@pytest.fixture
def project() -> str:
    return f"client-{uuid.uuid4().hex[:8]}"


def fed_run(c: Client, project: str, name: str = "run", rows: list | None = None) -> Run:
    run = c.create_run(project, name, config={"n_layers": LAYERS})
    rows = rows or [[0.1, 0.2, 0.3, 0.4]] * 5
    c.send_reports(
        run,
        [
            report(10 * i, {"qkai": row, "stable_rank": [1.0, "nan", "inf", "-inf"]}, scalars={"loss": 2.0 - i / 10})
            for i, row in enumerate(rows)
        ],
    )
    return run


# ---- settings ------------------------------------------------------------------------------------------


@pytest.fixture
def authenticated(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A live collector that wants tokens, and a token of project "p"."""
    db = f"sqlite:///{tmp_path / 'auth.db'}"
    engine = make_engine(db)
    upgrade(engine)
    store = Store(engine)
    _, secret = store.create_token("p", ["ingest", "read", "control"], name="client-test")
    store.close()
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qkwatch.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database-url",
                db,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url, secret
    finally:
        proc.terminate()
        proc.wait(30)


def test_url_and_token_come_from_the_environment(authenticated, monkeypatch):
    url, secret = authenticated
    monkeypatch.setenv("QKWATCH_URL", url)
    monkeypatch.setenv("QKWATCH_TOKEN", secret)
    with Client() as c:
        assert c.base_url == url and c.create_run("p", "from-env").name == "from-env"
    with Client(token="qkw_wrong") as c, pytest.raises(CollectorError) as err:  # an argument beats the variable
        c.run("p/from-env")
    assert err.value.status == 401
    monkeypatch.delenv("QKWATCH_TOKEN")
    with Client() as c, pytest.raises(CollectorError) as err:
        c.run("p/from-env")
    assert err.value.status == 401
    monkeypatch.delenv("QKWATCH_URL")
    assert Client().base_url == "http://127.0.0.1:8000"


# ---- typed results ---------------------------------------------------------------------------------------


def test_results_are_typed_with_timezone_aware_times(c, project):
    run = fed_run(c, project, rows=[[0.9] * 4] * 3)
    assert isinstance(run, Run) and run.ref == f"{project}/run"
    got = c.run(run)
    assert got.created_at.tzinfo == timezone.utc and got.last_report_at >= got.created_at
    assert got.created_at == datetime.fromtimestamp(got["created_at"], timezone.utc)  # the JSON stays readable
    assert got.last_step == 20 and got.config == {"n_layers": LAYERS}
    page = c.runs(project=project)
    assert isinstance(page, Page) and page.count == 1 and [r.id for r in page] == [run.id]
    assert page["data"][0]["id"] == run.id and page[0].updated_at.tzinfo == timezone.utc
    metrics = c.metrics(run)  # the same shape rule as runs(): a typed object of the whole answer
    assert isinstance(metrics, RunMetrics) and metrics.metrics == {
        "loss": [-1],
        "qkai": [0, 1, 2, 3],
        "stable_rank": [0, 1, 2, 3],
    }
    assert metrics["metrics"] == metrics.metrics
    alerts = c.alerts(run=run, state="firing")
    assert alerts.count == 5 and all(isinstance(a, Alert) and a.starts_at.tzinfo for a in alerts)  # 4 layers, a band
    assert alerts[0].ends_at is None and sum("0.9 at onset" in a.summary for a in alerts) == 4
    c.send_reports(run, [report(30, events=[{"kind": "note", "message": "m", "data": {"k": 1}}])])
    (event,) = c.events(run, kind="note")
    assert isinstance(event, Event) and event.time == datetime.fromtimestamp(30, timezone.utc)
    c.set_overrides(run, {1: 0.0})
    (entry,) = c.lambdas_audit(run)
    assert isinstance(entry, AuditEntry) and entry.new == 0.0 and entry.at.tzinfo == timezone.utc
    assert json.loads(json.dumps(dict(got)))["id"] == run.id


def test_an_alert_its_run_ended_with_is_typed_as_ended_with_its_last_values(c, project):
    run = fed_run(c, project, rows=[[0.9, 0.2, 0.2, 0.2]] * 2 + [["inf", 0.2, 0.2, 0.2]])
    c.set_status(run, "crashed")
    (alert,) = c.alerts(run=run, state="ended")
    assert isinstance(alert, Alert) and alert.state == "ended" and alert.ended_while_firing
    assert (alert.ended_step, alert.run_end, alert.resolved_step) == (20, "crashed", None)
    assert alert.last_values == [math.inf] and alert["last_values"] == ["inf"]  # typed; the JSON as sent
    assert alert.ends_at is not None and alert.ends_at.tzinfo == timezone.utc
    assert c.alerts(run=run, state="firing").count == 0 and c.alerts(run=run, state="resolved").count == 0
    live = fed_run(c, project, "live", rows=[[0.9] * 4] * 3)
    assert not any(a.ended_while_firing or a.last_values for a in c.alerts(run=live))


def test_nan_and_infinities_are_floats_in_every_result(c, project):
    run = fed_run(c, project)
    s = c.series(run, "stable_rank", layer=1)
    assert all(math.isnan(v) for v in s.values + s.min + s.max) and s["values"][0] == "nan"
    assert c.series(run, "stable_rank", layer=2).values == [math.inf] * 5
    h = c.heatmap(run, "stable_rank")
    assert h.values[0][0] == 1.0 and math.isnan(h.values[0][1]) and h.values[0][2:] == [math.inf, -math.inf]
    other = fed_run(c, project, "other")
    compared = c.compare([run, other.ref], "stable_rank", layer=3)
    assert [x.values for x in compared.series] == [[-math.inf] * 5] * 2
    cols = c.history(run, metrics=["stable_rank"], frame=False)
    assert [v for v, la in zip(cols["stable_rank"], cols["layer"], strict=True) if la == 3] == [-math.inf] * 5
    lam = c.lambdas(run)
    assert all(isinstance(x, float) for x in lam.lambdas) and lam.overrides == {}


# ---- a run by project/name ------------------------------------------------------------------------------


def test_every_method_takes_project_slash_name(c, project):
    name = "é-run%2"  # Latin-1 (the export names its file after the run)
    run = fed_run(c, project, name)
    ref = f"{project}/{name}"
    assert c.run(ref).id == run.id and c.set_status(ref, "finished").status == "finished"
    assert c.send_reports(ref, [report(99, {"qkai": [0.5] * 4})]).inserted == 4
    assert c.series(ref, "qkai", layer=0).steps[-1] == 99
    assert c.heatmap(ref).layers == [0, 1, 2, 3] and c.metrics(ref).metrics["loss"] == [-1]
    assert c.history(ref, metrics=["qkai"], frame=False)["step"][-1] == 99
    assert c.events(ref).count == 0 and c.alerts(run=ref).count == 0
    assert len(list(c.export(ref, format="jsonl"))) == 5 * 9 + 4
    assert c.set_overrides(ref, {0: 0.0}).overrides == {0: 0.0} and c.lambdas(ref).overrides == {0: 0.0}
    assert c.lambdas_audit(ref).count == 1
    c.delete_run(ref)
    with pytest.raises(CollectorError) as err:
        c.run(ref)
    assert err.value.status == 404


# ---- search and history ---------------------------------------------------------------------------------


def test_search_runs_by_what_happened(c, project):
    fed_run(c, project, "calm")
    band = fed_run(c, project, "band", rows=[[0.9, 0.9, 0.9, 0.1]] * 3)
    spike = fed_run(c, project, "spike", rows=[[0.1] * 4, [0.8, 0.1, 0.1, 0.1], [0.1] * 4])
    c.set_status(spike, "finished")
    assert sorted(r.name for r in c.search_runs(project, qkai_above=0.7)) == ["band", "spike"]
    assert [r.name for r in c.search_runs(project, qkai_latest_above=0.7)] == ["band"]
    assert [r.name for r in c.search_runs(project, collapse_band=True)] == ["band"]
    assert sorted(r.name for r in c.search_runs(project, collapse_band=False)) == ["calm", "spike"]
    assert [r.name for r in c.search_runs(project, status="finished")] == ["spike"]
    assert len(c.search_runs(project, created_after=band.created_at)) == 2  # a datetime, inclusive
    assert len(c.search_runs(project, created_after=band.created_at.isoformat())) == 2
    assert len(c.search_runs(project, max_results=2)) == 2


def test_tags_and_notes_are_typed_searched_and_changed(c, project):
    run = c.create_run(project, "tagged", tags=["lr=3e-4", "baseline"], notes="why\nhow")
    assert isinstance(run.tags, tuple) and run.tags == ("baseline", "lr=3e-4") and run.notes == "why\nhow"
    assert run["tags"] == ["baseline", "lr=3e-4"]  # the JSON as sent
    plain = c.create_run(project, "plain")
    assert (plain.tags, plain.notes) == ((), None)
    c.create_run(project, "other", tags="baseline")  # one string is one tag
    assert sorted(r.name for r in c.search_runs(project, tags=["baseline"])) == ["other", "tagged"]
    assert [r.name for r in c.search_runs(project, tags=["baseline", "lr=3e-4"])] == ["tagged"]
    assert [r.name for r in c.runs(project, tags=["lr=3e-4"])] == ["tagged"]
    assert [r.name for r in c.search_runs(project, tags=["baseline"], max_results=1)] == ["other"]  # paged
    assert c.tag(run, "diverged").tags == ("baseline", "diverged", "lr=3e-4")
    assert c.untag(f"{project}/tagged", "baseline", "never-had").tags == ("diverged", "lr=3e-4")
    changed = c.update_run(run, tags=["x"], notes="")
    assert (changed.tags, changed.notes) == (("x",), None)
    assert c.update_run(run, notes="again").tags == ("x",)  # tags left out: kept
    with pytest.raises(CollectorError) as refused:
        c.tag(run, "fine", "not fine")
    assert refused.value.status == 422 and "add_tags.1" in refused.value.message
    assert (c.run(run).tags, c.run(run).notes) == (("x",), "again")
    older = Run.of({k: v for k, v in run.raw.items() if k not in ("tags", "notes")})  # a collector before tags
    assert (older.tags, older.notes) == ((), None)


def test_history_as_a_dataframe_and_as_plain_columns(c, project, monkeypatch):
    pd = pytest.importorskip("pandas")
    run = fed_run(c, project)
    df = c.history(run, metrics=["qkai", "loss"])
    assert isinstance(df, pd.DataFrame) and list(df.columns) == ["step", "layer", "qkai", "loss"]
    assert len(df) == 5 * (4 + 1)
    assert df["step"].tolist()[:5] == [0] * 5 and df["layer"].tolist()[:5] == [-1, 0, 1, 2, 3]
    assert df.pivot(index="step", columns="layer", values="qkai")[2].tolist() == [0.3] * 5
    assert df.loc[df["layer"] == -1, "loss"].tolist() == [2.0, 1.9, 1.8, 1.7, 1.6]
    cols = c.history(run, metrics=["qkai", "loss"], frame=False)
    assert cols["step"] == df["step"].tolist() and cols["layer"] == df["layer"].tolist()
    assert cols["qkai"][:2] == [None, 0.1] and cols["loss"][:2] == [2.0, None]  # None: not measured there
    as_rows = c._json("GET", f"/v1/runs/{run.id}/history", params={"metrics": "qkai,loss"})  # encoding=json
    assert history_columns(as_rows) == cols and history_frame(as_rows).equals(df)
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not installed: plain columns
    assert c.history(run, metrics=["qkai", "loss"]) == cols


def test_an_unanswerable_query_raises_naming_the_problem(c, project):
    run = fed_run(c, project)
    for call, words in (
        (lambda: c.series(run, "qkai"), "layer"),
        (lambda: c.series(run, "nope"), "'nope'"),
        (lambda: c.series(run, "qkai", layer=99), "layer 99"),
        (lambda: c.history(run, metrics=["nope"]), "'nope'"),
    ):
        with pytest.raises(CollectorError) as err:
            call()
        assert err.value.status in (404, 422) and words in err.value.message


def test_the_client_module_needs_no_pandas():
    code = "import sys; sys.modules['pandas'] = None; import qkwatch.client.rest"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
