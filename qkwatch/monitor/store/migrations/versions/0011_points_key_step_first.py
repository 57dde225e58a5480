"""Points keyed (run, metric id, head, step, layer, attempt): a batch of reports writes few pages.

Before, the primary key was (run, metric id, head, layer, step, attempt), which keeps each layer's
series together: a batch of 10 reports of 24 layers x 6 metrics wrote 10 points into each of 144
places in the index, so every batch dirtied at least 144 leaf pages (and their WAL frames). With
the step before the layer, a batch's points of one metric are next to each other, at the end of
the run's range: a few pages per metric. Layer series are read from the frames since this revision
(``monitor.store.values.reads.series``); the points keep the per-head values, the scalars, the export and
the dashboards' view, none of which reads one layer over many steps.

SQLite: the table is rebuilt (copied in key order, the old one dropped after the copy) because a
WITHOUT ROWID table's key cannot be altered. PostgreSQL: the primary key's index is rebuilt in place
(``qkwatch_points_v`` depends on the table, so it is not renamed). Both take time in proportion to
the points stored; nothing is deleted before it has been copied.

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-10 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

COLS = "run_pk, metric_id, head, layer, step, attempt, value"


def upgrade() -> None:
    _rekey(("run_pk", "metric_id", "head", "step", "layer", "attempt"))


def downgrade() -> None:
    _rekey(("run_pk", "metric_id", "head", "layer", "step", "attempt"))


def _rekey(key: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"ALTER TABLE points DROP CONSTRAINT points_pkey, ADD CONSTRAINT points_pkey PRIMARY KEY ({', '.join(key)})"
        )
        return
    op.create_table(
        "points_new",
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column("metric_id", sa.Integer(), nullable=False),
        sa.Column("head", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint(*key, name="pk_points"),
        sqlite_with_rowid=False,
    )
    op.execute(f"INSERT INTO points_new ({COLS}) SELECT {COLS} FROM points ORDER BY {', '.join(key)}")
    op.drop_table("points")
    # The dashboards' view names ``points``: SQLite's rename would rewrite or reject it (its table is
    # gone for a moment); the legacy rename leaves views alone, and the view finds the new table by name.
    op.execute("PRAGMA legacy_alter_table = ON")
    op.rename_table("points_new", "points")
    op.execute("PRAGMA legacy_alter_table = OFF")
