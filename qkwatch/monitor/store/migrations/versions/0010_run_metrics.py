"""The metric names each run uses (``run_metrics``), and the names no run uses deleted.

``run_metrics`` (``run_pk``, ``metric_id``; both the primary key) has a row per metric name a run
has stored points of; ``metric_id`` references ``metric_names.id`` (``fk_run_metrics_metric_id``,
ON UPDATE CASCADE), indexed by ``ix_run_metrics_metric_id``. It bounds a run's names (the
collector's ``max_metric_names_per_run``) and tells which names no run uses, so that they can be
deleted, without reading points.

The upgrade fills it from the points and frames stored (one pass over each), then deletes the names
no run uses (those of deleted runs: before this revision no name was ever deleted). Points and
frames whose metric id has no name are deleted too, with a warning giving their count: a collector
of an earlier revision could write them after its database was re-created or restored under it
(issue 21, H1); no read can reach them, since every read finds a metric by its name, and a name
given that id later would otherwise take them for its own.

The downgrade drops the table; the names deleted are not brought back (no run used them).

Revision ID: 0010
Revises: 0009
Create Date: 2027-02-03 09:00:00
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

logger = logging.getLogger(__name__)

CHUNK = 1000


def upgrade() -> None:
    op.create_table(
        "run_metrics",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("metric_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["metric_id"], ["metric_names.id"], name="fk_run_metrics_metric_id", onupdate="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_pk", "metric_id"),
    )
    op.create_index("ix_run_metrics_metric_id", "run_metrics", ["metric_id"])
    conn = op.get_bind()
    named = set(conn.execute(sa.text("SELECT id FROM metric_names")).scalars())
    pairs = conn.execute(
        sa.text("SELECT DISTINCT run_pk, metric_id FROM points UNION SELECT DISTINCT run_pk, metric_id FROM frames")
    ).all()
    used = [{"run_pk": run_pk, "metric_id": metric_id} for run_pk, metric_id in pairs if metric_id in named]
    for i in range(0, len(used), CHUNK):
        conn.execute(
            sa.text("INSERT INTO run_metrics (run_pk, metric_id) VALUES (:run_pk, :metric_id)"), used[i : i + CHUNK]
        )
    _delete_nameless(conn, [(run_pk, metric_id) for run_pk, metric_id in pairs if metric_id not in named])
    conn.execute(sa.text("DELETE FROM metric_names WHERE id NOT IN (SELECT metric_id FROM run_metrics)"))


def _delete_nameless(conn: sa.Connection, pairs: list[tuple[int, int]]) -> None:
    """Delete the points and frames of (run, metric id) pairs whose id has no name (an index range each)."""
    if not pairs:
        return
    points = frames = 0
    for run_pk, metric_id in pairs:
        key = {"run_pk": run_pk, "metric_id": metric_id}
        points += conn.execute(
            sa.text("DELETE FROM points WHERE run_pk = :run_pk AND metric_id = :metric_id"), key
        ).rowcount
        frames += conn.execute(
            sa.text("DELETE FROM frames WHERE run_pk = :run_pk AND metric_id = :metric_id"), key
        ).rowcount
    logger.warning(
        "deleted %d points and %d frames of %d (run, metric id) pairs whose metric id has no name "
        "(written by an earlier collector after its database was re-created or restored under it)",
        points,
        frames,
        len(pairs),
    )


def downgrade() -> None:
    op.drop_index("ix_run_metrics_metric_id", table_name="run_metrics")
    op.drop_table("run_metrics")
