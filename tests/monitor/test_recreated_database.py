"""A database re-created, rebuilt or migrated under a running collector never mixes up series (issue 21, H1).

The collector once cached metric name -> id for the life of the process and trusted it: after the
database was dropped and made again (or restored, or its id table rebuilt), a new name took an id
the cache still gave to another, and one metric's series showed another's values. These tests run
the red team's reproduction against real collector processes (``qkwatch serve``) on SQLite (its
tables dropped and made again) and PostgreSQL (the database dropped and created, or its tables),
with the real ``qkwatch db upgrade``; the in-process variant (a rebuilt id table) uses the app on a
real database.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from qkwatch.client.rest import Client
from qkwatch.launch import CollectorProcess
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.migrate import alembic_config
from tests.live import ROOT
from tests.monitor.conftest import PG_ADMIN_URL, Harness

LAYERS = 3
STEPS = range(5)
BASE = {"aaa_new": 9.0, "attn_entropy": 2.0, "qkai": 0.5}
"""Each metric's values are BASE + step / 10 + layer / 100: no two metrics share a value."""


@pytest.fixture
def db_url(isolated_db_url: str) -> str:
    """A database of its own: these tests drop it, or everything in it."""
    return isolated_db_url


def value(metric: str, step: int, layer: int) -> float:
    return round(BASE[metric] + step / 10 + layer / 100, 6)


def reports(*metrics: str, steps: range = STEPS) -> list[dict]:
    return [
        {"step": s, "time": float(s), "layers": {m: [value(m, s, la) for la in range(LAYERS)] for m in metrics}}
        for s in steps
    ]


def post(client: Client, run_id: str, *metrics: str, steps: range = STEPS) -> tuple[int, int]:
    done = client.send_reports(run_id, reports(*metrics, steps=steps))
    return done.inserted, done.duplicates


def assert_series(client: Client, run: str, metric: str, steps: range = STEPS) -> None:
    for layer in range(LAYERS):
        got = client.series(run, metric, layer=layer)
        assert (got.steps, list(got.values)) == (list(steps), [value(metric, s, layer) for s in steps]), (metric, layer)


def exported(client: Client, run: str) -> dict[tuple[str, int, int], float]:
    rows = csv.DictReader(client.export(run, format="csv"))
    return {(r["metric"], int(r["step"]), int(r["layer"])): float(r["value"]) for r in rows}


def expected(*metrics: str) -> dict[tuple[str, int, int], float]:
    return {(m, s, la): value(m, s, la) for m in metrics for s in STEPS for la in range(LAYERS)}


def db_upgrade(url: str) -> None:
    """The real ``qkwatch db upgrade``, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "db", "upgrade", "--database-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def recreate(url: str, how: str) -> None:
    """Make the database empty again, the way an operator would: drop it and create it again ("recreate",
    PostgreSQL), or migrate it down to nothing, every table dropped ("downgrade"); ``qkwatch db upgrade``
    comes after. (A SQLite file deleted or replaced under a running collector is refused until a restart:
    tests/monitor/test_sqlite_file_gone.py.)"""
    if how == "downgrade":
        engine = make_engine(url)
        cfg = alembic_config()
        with engine.connect().execution_options(write=True) as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "base")
            conn.commit()
        engine.dispose()
        return
    name = sa.make_url(url).database
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()


WAYS = [("sqlite", "downgrade"), ("postgres", "recreate"), ("postgres", "downgrade")]
"""(database, how it is made empty again) of the tests below."""


def points_in_the_database(url: str, run_id: str) -> dict[tuple[str, int, int], float]:
    """The run's layer values as a fresh connection reads them from the database itself."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT n.name, p.step, p.layer, p.value FROM points p JOIN metric_names n ON n.id = p.metric_id "
                    "JOIN runs r ON r.pk = p.run_pk WHERE r.id = :id AND p.head = -1"
                ),
                {"id": run_id},
            ).all()
        return {(r[0], r[1], r[2]): r[3] for r in rows}
    finally:
        engine.dispose()


@pytest.fixture
def collectors() -> Iterator[list[CollectorProcess]]:
    """Collectors over ``db_url`` (``qkwatch serve --open``), made by the test, stopped at its end."""
    made: list[CollectorProcess] = []
    yield made
    for c in made:
        c.stop()


def collector(made: list[CollectorProcess], tmp_path: Path, url: str) -> CollectorProcess:
    c = CollectorProcess(url, log=tmp_path / f"collector-{len(made)}.log", cwd=ROOT)
    made.append(c)
    return c.start()


@pytest.mark.parametrize(("isolated_db_url", "how"), WAYS, indirect=["isolated_db_url"])
def test_a_recreated_database_never_mixes_up_series(collectors, tmp_path: Path, db_url: str, how: str):
    """The red team's reproduction (H1), the collector running throughout: qkai and attn_entropy are
    stored; the database is made again (dropped and created, or migrated down to nothing) and
    ``qkwatch db upgrade`` runs; a new metric aaa_new is posted, then qkai and attn_entropy again.
    Every point is new, and each metric reads back its own values."""
    live = collector(collectors, tmp_path, db_url)
    with live.client() as c:
        before = c.create_run("h1", "r")
        assert post(c, before.id, "qkai", "attn_entropy") == (30, 0)
        recreate(db_url, how)
        db_upgrade(db_url)
        run = c.create_run("h1", "r")
        assert run.id != before.id  # a new database: the run is new there, not the old one resumed
        assert post(c, run.id, "aaa_new") == (15, 0)
        assert post(c, run.id, "qkai", "attn_entropy") == (30, 0)
        for metric in BASE:
            assert_series(c, run.id, metric)
        assert exported(c, run.id) == expected(*BASE)
        assert c.health().status == "ok"
    assert points_in_the_database(db_url, run.id) == expected(*BASE)


@pytest.mark.parametrize(("isolated_db_url", "how"), WAYS[:2], indirect=["isolated_db_url"])
def test_two_collectors_one_of_which_recreates_the_database(collectors, tmp_path: Path, db_url: str, how: str):
    """Collector A stores qkai and attn_entropy; the database is made empty again and collector B,
    started on it, migrates it (as every ``qkwatch serve`` does) and stores aaa_new; then A stores qkai
    and attn_entropy in the same run. Both collectors read every metric back as it was sent."""
    a = collector(collectors, tmp_path, db_url)
    with a.client() as ca:
        old = ca.create_run("h1", "two")
        assert post(ca, old.id, "qkai", "attn_entropy") == (30, 0)
        recreate(db_url, how)
        b = collector(collectors, tmp_path, db_url)  # migrates the empty database on start
        with b.client() as cb:
            run = cb.create_run("h1", "two")
            assert post(cb, run.id, "aaa_new") == (15, 0)
            assert post(ca, "h1/two", "qkai", "attn_entropy") == (30, 0)
            for client in (ca, cb):
                for metric in BASE:
                    assert_series(client, "h1/two", metric)
                assert exported(client, "h1/two") == expected(*BASE)
    assert points_in_the_database(db_url, run.id) == expected(*BASE)


def test_a_rebuilt_metric_id_table(make_harness):
    """The id table is rebuilt under a running app (every id renumbered, points and frames moved along,
    and a new name given an id that an old one had): later reports and reads use the new ids."""
    h: Harness = make_harness()
    run = h.create_run()["id"]
    first = h.send(run, reports("qkai", "attn_entropy"))
    assert (first["inserted"], first["duplicates"]) == (30, 0)
    with h.store.engine.begin() as conn:
        old_ids = dict(conn.execute(sa.text("SELECT name, id FROM metric_names")).all())
        for table in ("points", "frames", "metric_names"):  # run_metrics (0010) follows by its foreign key
            column = "id" if table == "metric_names" else "metric_id"
            conn.execute(sa.text(f"UPDATE {table} SET {column} = {column} + 1000"))
        conn.execute(
            sa.text("INSERT INTO metric_names (id, name) VALUES (:id, 'aaa_new')"), {"id": min(old_ids.values())}
        )
    later = range(5, 10)
    new = h.send(run, reports("aaa_new"))
    assert (new["inserted"], new["duplicates"]) == (15, 0)
    again = h.send(run, reports("qkai", "attn_entropy", steps=later))
    assert (again["inserted"], again["duplicates"]) == (30, 0)
    for metric, steps in (("aaa_new", STEPS), ("qkai", range(10)), ("attn_entropy", range(10))):
        for layer in range(LAYERS):
            got = h.get(f"/v1/runs/{run}/series", metric=metric, layer=layer)
            assert (got["steps"], got["values"]) == (list(steps), [value(metric, s, layer) for s in steps])
    grid = h.get(f"/v1/runs/{run}/heatmap", metric="attn_entropy")
    assert grid["values"] == [[value("attn_entropy", s, la) for la in range(LAYERS)] for s in range(10)]
