"""Runs get tags and notes.

``run_tags`` (``run_pk``, ``tag``; both the primary key): one row per tag of a run. The primary key
reads a run's tags; the index ``ix_run_tags_tag`` (``tag``, ``run_pk``) finds the runs that have a tag
(``GET /v1/runs?tag=...``). ``runs.notes`` (text, nullable): the run's notes, NULL when it has none.
What a tag may hold and the bounds are the wire schema's (``contract.wire.TAG_PATTERN``, ``MAX_TAGS``,
``MAX_NOTES_BYTES``); existing runs get no tags and no notes.

The view ``qkwatch_runs_v`` (0004) gains two last columns: ``tags``, the run's tags sorted in byte
order and joined with commas (NULL when it has none; a tag holds no comma), and ``notes``. On
PostgreSQL CREATE OR REPLACE VIEW adds them and keeps the grant; the view reads ``run_tags`` with its
owner's rights, so the Grafana role still reads only views.

The downgrade makes the view again as 0004 made it (with its grant), drops ``run_tags`` and the
column. SQLite's batch mode (copy, drop, rename) refuses while a view reads the table, and every
dashboard view reads ``runs``: they are dropped first and made again, from their own SQL, afterwards.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-20 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

ROLE = "qkwatch_grafana"

_RUNS_V = """
        SELECT r.project, r.name AS run_name, r.id AS run_id, r.status, r.status_reason,
               r.latest_attempt AS attempt, r.last_step, r.created_at, r.updated_at, r.last_report_at{extra}
        FROM runs r"""

# The tags of run r, sorted in byte order (PostgreSQL's "C" collation; SQLite's default BINARY is
# the same), comma-joined; NULL when it has none. SQLite's group_concat takes the order of the rows
# it is given (it has no ORDER BY of its own before 3.44).
_TAGS = {
    "postgresql": "(SELECT string_agg(t.tag, ',' ORDER BY t.tag COLLATE \"C\") FROM run_tags t WHERE t.run_pk = r.pk)",
    "sqlite": "(SELECT group_concat(tag, ',') FROM "
    "(SELECT t.tag FROM run_tags t WHERE t.run_pk = r.pk ORDER BY t.tag))",
}

_GRANT = f"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
        GRANT SELECT ON qkwatch_runs_v TO {ROLE};
    END IF;
END
$$"""


def _dialect() -> str:
    return op.get_bind().dialect.name


def upgrade() -> None:
    op.add_column("runs", sa.Column("notes", sa.Text(), nullable=True))
    op.create_table(
        "run_tags",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("tag", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("run_pk", "tag"),
    )
    op.create_index("ix_run_tags_tag", "run_tags", ["tag", "run_pk"])
    view = _RUNS_V.format(extra=f", {_TAGS[_dialect()]} AS tags, r.notes").strip()
    if _dialect() == "postgresql":
        op.execute(f"CREATE OR REPLACE VIEW qkwatch_runs_v AS {view}")
    else:
        op.execute("DROP VIEW IF EXISTS qkwatch_runs_v")
        op.execute(f"CREATE VIEW qkwatch_runs_v AS {view}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS qkwatch_runs_v")
    op.execute(f"CREATE VIEW qkwatch_runs_v AS {_RUNS_V.format(extra='').strip()}")
    if _dialect() == "postgresql":
        op.execute(_GRANT)
    op.drop_index("ix_run_tags_tag", table_name="run_tags")
    op.drop_table("run_tags")
    if _dialect() == "postgresql":
        op.drop_column("runs", "notes")
        return
    views = op.get_bind().execute(sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view'")).all()
    for name, _ in views:
        op.execute(f'DROP VIEW "{name}"')
    with op.batch_alter_table("runs") as batch_op:
        batch_op.drop_column("notes")
    for _, create in views:
        op.execute(create)
