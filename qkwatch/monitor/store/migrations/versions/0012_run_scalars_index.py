"""A partial index of the run scalars among the points (``ix_points_run_scalars``).

Since 0011 the points' key is (run, metric id, head, step, layer, attempt): a metric's scalars
(layer -1: a loss, a health value) lie one per step among its layer values, so a read of the
scalars (the whole-run history, a scalar's series) scanned every layer value of the metric: 7 ms
for 72,000 points on SQLite, twice per history call (`bench/history.py`). The index holds only the
rows with head -1 and layer -1, keyed (run, metric id, head, layer, step, attempt) and covering the
value. Ingest adds a row to it per scalar point only.

Building it reads every point once. On PostgreSQL it is a plain ``CREATE INDEX`` (not
``CONCURRENTLY``: the migrations run in one transaction), so collectors' writes to ``points`` wait
until it is built: on a large database, upgrade at a quiet time (``qkwatch db upgrade`` before the
collectors start). Reads are not held up.

Revision ID: 0012
Revises: 0011
Create Date: 2027-02-17 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

WHERE = "head = -1 AND layer = -1"  # models.RUN_SCALARS as of this revision


def upgrade() -> None:
    op.create_index(
        "ix_points_run_scalars",
        "points",
        ["run_pk", "metric_id", "head", "layer", "step", "attempt", "value"],
        sqlite_where=sa.text(WHERE),
        postgresql_where=sa.text(WHERE),
    )


def downgrade() -> None:
    op.drop_index("ix_points_run_scalars", table_name="points")
