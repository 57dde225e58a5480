"""Metric names and their ids: points and frames store a small integer instead of the name.

An id is read in the transaction that uses it and never kept beyond it: a database dropped and made
again, restored from a backup, failed over to a replica or with its id table rebuilt gives the same
name another id (or the same id to another name), and only the database knows which. An ingest
takes its batch's ids with one query when the run has every name already (:func:`ids_for_batch`),
a read looks its metric up with one (:func:`lookup`).

Names no run uses any more are deleted (:func:`reclaim`: after a run is deleted, and by the
maintenance loop). An ingest and a reclaim never disagree about a name:

* PostgreSQL: a name its run has already is no candidate (its ``run_metrics`` row stays while the
  run does, and the ingest holds the run's lock). A name new to the run is locked ``FOR KEY SHARE``
  by the ingest until it commits; the reclaim locks its candidates ``FOR UPDATE SKIP LOCKED``
  (never waiting, so never part of a deadlock), skipping every name an ingest holds, and deletes
  only those that no run uses as a new statement sees it. An ingest that reaches a name while a
  reclaim deletes it waits for the reclaim, finds the row gone and gives the name a new id.
* SQLite: every write transaction holds the database's one write lock (``BEGIN IMMEDIATE``).
* Both: ``run_metrics`` has a foreign key to ``metric_names``, so a name that a run uses cannot be
  deleted, and an id that no longer exists cannot be recorded for a run: a mistake is an error
  (the batch is answered 500 and retried by the agent), never a point under the wrong name.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql
from qkwatch.monitor.store.engine import is_postgres
from qkwatch.monitor.store.errors import Invalid

SHOWN_NAMES = 5
"""How many of the new names a refusal over the per-run limit quotes."""


def ids_for_batch(conn: sa.Connection, run: m.RunRow, names: Iterable[str], limit: int | None) -> dict[str, int]:
    """The id of each of ``names`` for an ingest into ``run`` (locked by the caller), in its transaction.

    One plain query when the run has stored every name before (the usual batch): a name the run
    has cannot be deleted while the run exists, and the run cannot be deleted under its lock. A
    name new to the run is locked against a reclaim (PostgreSQL), inserted when the database does
    not have it, and recorded in ``run_metrics``, all in the caller's transaction: a batch refused
    or rolled back leaves no name behind.

    Args:
        limit: the most distinct metric names the run may have (None: no limit).

    Raises:
        Invalid: the batch would take the run past ``limit`` names (nothing is written).
    """
    wanted = sorted(set(names))
    if not wanted:
        return {}
    known = _select(conn, run.pk, wanted, lock=False)
    new = [n for n in wanted if n not in known or not known[n][1]]
    if not new:
        return {n: known[n][0] for n in wanted}
    if limit is not None:
        _check_limit(conn, run, new, limit)
    held = _select(conn, run.pk, new, lock=True)
    missing = [n for n in new if n not in held]
    for _ in range(3):  # a second round only when a reclaim deleted a name between our insert and our lock
        if not missing:
            break
        conn.execute(sql.insert(conn, m.metric_names).on_conflict_do_nothing(), [{"name": n} for n in missing])
        held |= _select(conn, run.pk, missing, lock=True)
        missing = [n for n in new if n not in held]
    if missing:
        raise RuntimeError(f"metric names {missing} were deleted three times while this batch took them")
    rows = [{"run_pk": run.pk, "metric_id": held[n][0]} for n in new]
    conn.execute(sql.insert(conn, m.run_metrics).on_conflict_do_nothing(), rows)
    return {n: held[n][0] if n in held else known[n][0] for n in wanted}


# Text, not a Core select built per call: the usual batch runs only this, and building and caching
# a select costs about 8x what running it does on SQLite (~180 us against ~25 us of CPU).
_NAMES = (
    "SELECT n.id, n.name, rm.metric_id IS NOT NULL AS used FROM metric_names n "
    "LEFT JOIN run_metrics rm ON rm.run_pk = :run_pk AND rm.metric_id = n.id "
    "WHERE n.name IN :names ORDER BY n.id"
)
_SELECT = sa.text(_NAMES).bindparams(sa.bindparam("names", expanding=True))
_SELECT_LOCKED_PG = sa.text(_NAMES + " FOR KEY SHARE OF n").bindparams(sa.bindparam("names", expanding=True))


def _select(conn: sa.Connection, run_pk: int, names: list[str], *, lock: bool) -> dict[str, tuple[int, bool]]:
    """name -> (id, whether the run has it) of the names that exist.

    ``lock``: on PostgreSQL each row is locked ``FOR KEY SHARE`` until the transaction ends (a reclaim
    skips it), in id order, so that two transactions never wait on each other in a circle.
    """
    query = _SELECT_LOCKED_PG if lock and is_postgres(conn) else _SELECT
    return {r.name: (r.id, bool(r.used)) for r in conn.execute(query, {"run_pk": run_pk, "names": names})}


def _check_limit(conn: sa.Connection, run: m.RunRow, new: list[str], limit: int) -> None:
    rm = m.run_metrics
    have = conn.execute(sa.select(sa.func.count()).select_from(rm).where(rm.c.run_pk == run.pk)).scalar_one()
    if have + len(new) > limit:
        shown = ", ".join(new[:SHOWN_NAMES]) + (f" and {len(new) - SHOWN_NAMES} more" if len(new) > SHOWN_NAMES else "")
        raise Invalid(
            f"reports: run {run.project}/{run.name} has {have} distinct metric names and this batch adds "
            f"{len(new)} ({shown}); the limit is {limit} names per run (max_metric_names_per_run, "
            "QKWATCH_MAX_METRIC_NAMES_PER_RUN); nothing of the batch was stored"
        )


def lookup(conn: sa.Connection, name: str) -> int | None:
    """The id of a metric name for a read; None when no run has it."""
    return conn.execute(sa.select(m.metric_names.c.id).where(m.metric_names.c.name == name)).scalar()


def lookup_many(conn: sa.Connection, names: Iterable[str]) -> dict[str, int]:
    """The ids of those of ``names`` some run has, in one query (a name no run has is left out)."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    n = m.metric_names
    return {name: i for name, i in conn.execute(sa.select(n.c.name, n.c.id).where(n.c.name.in_(wanted)))}


def reclaim(conn: sa.Connection) -> int:
    """Delete the names no run uses; returns how many. Never waits for an ingest (see the module docstring)."""
    n, rm = m.metric_names, m.run_metrics
    unused = ~sa.exists().where(rm.c.metric_id == n.c.id)
    candidates = sa.select(n.c.id).where(unused).order_by(n.c.id)
    if is_postgres(conn):
        candidates = candidates.with_for_update(skip_locked=True)
    ids = list(conn.execute(candidates).scalars())
    if not ids:
        return 0
    # A new statement, so a new snapshot on PostgreSQL: an ingest that committed a name for its run
    # after the candidates were read keeps it. (A row lock taken after a wait does not re-check
    # the NOT EXISTS of the statement that took it.)
    deleted = 0
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        deleted += conn.execute(sa.delete(n).where(n.c.id.in_(chunk), unused)).rowcount
    return deleted
