"""The runs table read: a run by id or name (locked for a write), runs by filters, with their tags.

How a run starts, resumes, ends and goes away is :mod:`qkwatch.monitor.store.runs.lifecycle`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError

from qkwatch.contract.values import clip_depth
from qkwatch.contract.wire import RunConfig
from qkwatch.monitor.store import metric_names
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.errors import NotFound

logger = logging.getLogger(__name__)

TERMINAL = ("finished", "crashed")
"""The statuses of a run that ended."""

SET_ASIDE = {"schedule": "the default schedule applies", "n_layers": "its layer count is unknown"}
"""What a run loaded from an older database gets instead of a typed key the API now refuses."""


def run_rows(conn: sa.Connection, rows: Sequence[sa.Row[Any]]) -> list[m.RunRow]:
    """Rows of ``runs`` as run rows, with their tags (one query for all of them)."""
    tags = tags_of(conn, [r.pk for r in rows])
    return [run_row(r, tags.get(r.pk, ())) for r in rows]


def tags_of(conn: sa.Connection, pks: Sequence[int]) -> dict[int, tuple[str, ...]]:
    """The tags of each run of ``pks`` that has any, sorted (in Python: the same order on both databases)."""
    if not pks:
        return {}
    found: dict[int, list[str]] = {}
    for run_pk, tag in conn.execute(_TAGS_OF, {"pks": list(pks)}):
        found.setdefault(run_pk, []).append(tag)
    return {pk: tuple(sorted(tags)) for pk, tags in found.items()}


# Statements of every ingest and most reads, built once: building a Core statement per call costs
# several times what running it costs on SQLite (about 70 against 20 microseconds for a run by id).
_TAGS_OF = sa.select(m.run_tags.c.run_pk, m.run_tags.c.tag).where(
    m.run_tags.c.run_pk.in_(sa.bindparam("pks", expanding=True))
)


def _tags_column(dialect: str) -> sa.Label[Any]:
    """The run's tags in its own row (one statement, not two): an array on PostgreSQL; on SQLite the
    tags joined by commas, which no tag holds (``wire.TAG_PATTERN``), without needing SQLite's JSON."""
    t = m.run_tags
    agg = sa.func.array_agg(t.c.tag) if dialect == "postgresql" else sa.func.group_concat(t.c.tag, ",")
    return sa.select(agg).where(t.c.run_pk == m.runs.c.pk).scalar_subquery().label("tags_")


_BY_ID = {
    d: sa.select(m.runs, _tags_column(d)).where(m.runs.c.id == sa.bindparam("run_id")) for d in ("postgresql", "sqlite")
}
_LOCKED = {d: stmt.with_for_update() for d, stmt in _BY_ID.items()}


def _with_tags(r: sa.Row[Any]) -> m.RunRow:
    """A row of ``_BY_ID`` or ``_LOCKED`` as a run row, its tags sorted as :func:`tags_of` sorts them."""
    tags = r.tags_ if r.tags_ is None or isinstance(r.tags_, list) else r.tags_.split(",")
    return run_row(r, tuple(sorted(tags or ())))


def run_row(r: sa.Row[Any], tags: tuple[str, ...]) -> m.RunRow:
    return m.RunRow(
        pk=r.pk,
        id=r.id,
        project=r.project,
        name=r.name,
        status=r.status,
        status_reason=r.status_reason,
        config=load_config(r.id, r.config),
        created_at=r.created_at,
        updated_at=r.updated_at,
        last_report_at=r.last_report_at,
        last_step=r.last_step,
        latest_attempt=r.latest_attempt,
        lambda_version=r.lambda_version,
        lambda_step=r.lambda_step,
        tags=tags,
        notes=r.notes,
    )


def load_config(run_id: str, text: str) -> RunConfig:
    """The typed config of a stored run: parsed here, once per row read, and nowhere else.

    A config written before the API validated it (an older database) may hold a ``schedule`` or
    an ``n_layers`` that the API now refuses. The run still loads: that key is set aside (the
    default schedule; an unknown layer count, so the lambdas are sized by the entropies seen and
    a resume may set it), a warning is logged once per run and key, and the stored text is kept
    as it is; reads serve the config without it. A config stored before its depth was bounded is
    read back cut at the bound (``clip_depth``).
    """
    raw = clip_depth(json.loads(text))
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        bad = {str(e["loc"][0]): e["msg"] for e in exc.errors() if e["loc"] and e["loc"][0] in SET_ASIDE}
        if not bad:
            raise
    for key, why in bad.items():
        _warn_set_aside(run_id, key, why)
    return RunConfig.model_validate({k: v for k, v in raw.items() if k not in bad})


@functools.lru_cache(maxsize=1024)
def _warn_set_aside(run_id: str, key: str, why: str) -> None:
    """Once per run and key (bounded): every read of the run would otherwise say it again."""
    logger.warning("run %s: its stored config.%s is set aside, %s: %s", run_id, key, SET_ASIDE[key], why)


def get(conn: sa.Connection, where: sa.ColumnElement[bool]) -> m.RunRow:
    """The one run matching ``where``; NotFound when none does."""
    r = conn.execute(sa.select(m.runs).where(where)).first()
    if r is None:
        raise NotFound("run not found")
    return run_rows(conn, [r])[0]


def by_id(conn: sa.Connection, run_id: str) -> m.RunRow:
    """The run ``run_id``, its tags read in the same statement; NotFound when there is none."""
    r = conn.execute(_BY_ID[conn.dialect.name], {"run_id": run_id}).first()
    if r is None:
        raise NotFound("run not found")
    return _with_tags(r)


def by_pk(conn: sa.Connection, pk: int) -> m.RunRow:
    """The run as it is now in this transaction (re-read after an update)."""
    return get(conn, m.runs.c.pk == pk)


def by_name(conn: sa.Connection, project: str, name: str) -> m.RunRow:
    return get(conn, sa.and_(m.runs.c.project == project, m.runs.c.name == name))


def locked(conn: sa.Connection, run_id: str) -> m.RunRow:
    """The run, locked for this write transaction.

    FOR UPDATE serialises the writes of one run across replicas on PostgreSQL (the schedule and
    the alert streaks are read-modify-write); SQLite's BEGIN IMMEDIATE already does.
    """
    r = conn.execute(_LOCKED[conn.dialect.name], {"run_id": run_id}).first()
    if r is None:
        raise NotFound(f"run {run_id} not found")
    return _with_tags(r)


def locked_by_name(conn: sa.Connection, project: str, name: str) -> m.RunRow | None:
    q = sa.select(m.runs).where(m.runs.c.project == project, m.runs.c.name == name)
    r = conn.execute(q.with_for_update()).first()
    return run_rows(conn, [r])[0] if r else None


def page(
    conn: sa.Connection, where: list[sa.ColumnElement[bool]], limit: int, offset: int
) -> tuple[list[m.RunRow], int]:
    """Runs matching every condition of ``where``, newest activity first, and their count."""
    r = m.runs
    count = conn.execute(sa.select(sa.func.count()).select_from(r).where(*where)).scalar()
    rows = conn.execute(
        sa.select(r).where(*where).order_by(r.c.updated_at.desc(), r.c.pk.desc()).limit(limit).offset(offset)
    ).all()
    return run_rows(conn, rows), int(count or 0)


def basic_filters(
    projects: Sequence[str] | None, status: str | None, name: str | None, tags: Sequence[str] = ()
) -> list[sa.ColumnElement[bool]]:
    """Conditions on the run's own columns (``projects`` None = all) and tags (the run has every one)."""
    r = m.runs
    where: list[sa.ColumnElement[bool]] = []
    if projects is not None:
        where.append(r.c.project.in_(list(projects)))
    where += [r.c.status == status] if status else []
    where += [r.c.name == name] if name else []
    t = m.run_tags
    # One index range of ix_run_tags_tag per tag.
    where += [r.c.pk.in_(sa.select(t.c.run_pk).where(t.c.tag == tag)) for tag in sorted(set(tags))]
    return where


def search_filters(
    conn: sa.Connection,
    *,
    created: tuple[float | None, float | None],
    updated: tuple[float | None, float | None],
    ever_above: tuple[str, float] | None,
    latest_above: tuple[str, float] | None,
    alerts: Sequence[tuple[Sequence[str], bool]],
) -> list[sa.ColumnElement[bool]]:
    """Conditions on times, on what the run reported and on its alerts (see ``Store.search_runs``)."""
    r = m.runs
    where: list[sa.ColumnElement[bool]] = []
    for column, (after, before) in ((r.c.created_at, created), (r.c.updated_at, updated)):
        where += [column >= after] if after is not None else []
        where += [column <= before] if before is not None else []
    if ever_above is not None:
        where.append(_ever_above(conn, *ever_above))
    if latest_above is not None:
        lt = m.latest
        where.append(
            sa.exists().where(lt.c.run_pk == r.c.pk, lt.c.metric == latest_above[0], lt.c.value > latest_above[1])
        )
    for rules, wanted in alerts:
        a = m.alerts
        had = sa.exists().where(a.c.run_pk == r.c.pk, a.c.rule.in_(list(rules)))
        where.append(had if wanted else ~had)
    return where


def _ever_above(conn: sa.Connection, metric: str, threshold: float) -> sa.ColumnElement[bool]:
    metric_id = metric_names.lookup(conn, metric)
    if metric_id is None:
        return sa.false()
    p = m.points
    # An index range per run: (run_pk, metric_id, head) is the primary key's prefix.
    return sa.exists().where(
        p.c.run_pk == m.runs.c.pk, p.c.metric_id == metric_id, p.c.head == m.LAYER_VALUE, p.c.value > threshold
    )
