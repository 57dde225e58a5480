"""Points and frames key metrics by a small integer id (table metric_names) instead of the name.

A narrower primary key makes every insert cheaper. Existing points and frames are copied into
the new tables with their metric's id; nothing is dropped before it has been copied.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 05:45:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Names compare bytewise on PostgreSQL (see monitor.store.models.Name).
NAME = sa.String(length=128).with_variant(sa.String(length=128, collation="C"), "postgresql")

POINT_COLS = "head, layer, step, attempt, value"
FRAME_COLS = "step, attempt, mask, vals, present, has_nan"


def _points_table(name: str, key: str, key_type: sa.types.TypeEngine[Any]) -> None:
    op.create_table(
        name,
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column(key, key_type, nullable=False),
        sa.Column("head", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("run_pk", key, "head", "layer", "step", "attempt"),
        sqlite_with_rowid=False,
    )


def _frames_table(name: str, key: str, key_type: sa.types.TypeEngine[Any]) -> None:
    op.create_table(
        name,
        sa.Column("run_pk", sa.Integer(), nullable=False),
        sa.Column(key, key_type, nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("mask", sa.String(length=24), nullable=False),
        sa.Column("vals", sa.LargeBinary(), nullable=False),
        sa.Column("present", sa.LargeBinary(), nullable=True),
        sa.Column("has_nan", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("run_pk", key, "step", "attempt", "mask"),
        sqlite_with_rowid=False,
    )


def _set_aside(table: str) -> None:
    op.rename_table(table, f"{table}_old")
    if op.get_bind().dialect.name == "postgresql":  # the primary key index keeps its name otherwise
        op.execute(f"ALTER INDEX {table}_pkey RENAME TO {table}_old_pkey")


def upgrade() -> None:
    op.create_table(
        "metric_names",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.execute(
        "INSERT INTO metric_names (name) SELECT DISTINCT metric FROM points UNION SELECT DISTINCT metric FROM frames"
    )
    for table, make, cols in (("points", _points_table, POINT_COLS), ("frames", _frames_table, FRAME_COLS)):
        _set_aside(table)
        make(table, "metric_id", sa.Integer())
        op.execute(
            f"INSERT INTO {table} (run_pk, metric_id, {cols}) SELECT o.run_pk, n.id, "
            f"{', '.join('o.' + c.strip() for c in cols.split(','))} FROM {table}_old o "
            "JOIN metric_names n ON n.name = o.metric"
        )
        op.drop_table(f"{table}_old")


def downgrade() -> None:
    for table, make, cols in (("points", _points_table, POINT_COLS), ("frames", _frames_table, FRAME_COLS)):
        _set_aside(table)
        make(table, "metric", NAME)
        op.execute(
            f"INSERT INTO {table} (run_pk, metric, {cols}) SELECT o.run_pk, n.name, "
            f"{', '.join('o.' + c.strip() for c in cols.split(','))} FROM {table}_old o "
            "JOIN metric_names n ON n.id = o.metric_id"
        )
        op.drop_table(f"{table}_old")
    op.drop_table("metric_names")
