"""The rate limit's token buckets move into the database; frames that disagree with their points are repaired.

``rate_buckets`` (key, tokens, updated_at): one row per token, so that the per-token rate holds
across every worker and replica on the database, not per process.

Before this revision, a report that re-sent a stored (step, layer) with another value, or with
more layers than before, kept the point's first value but stored a second frame carrying the new
one, which the heatmap then showed. Each frame of a (run, metric, step, attempt) that has more
than one is rewritten here with its points' values (the first stored, which the series and the
export show). The downgrade drops the table and leaves the frames as repaired.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

import math
from array import array

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rate_buckets",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    _repair_frames(op.get_bind())


def downgrade() -> None:
    op.drop_table("rate_buckets")


def _repair_frames(conn: sa.Connection) -> None:
    groups = conn.execute(
        sa.text(
            "SELECT run_pk, metric_id, step, attempt FROM frames GROUP BY run_pk, metric_id, step, attempt "
            "HAVING count(*) > 1"
        )
    ).all()
    for run_pk, metric_id, step, attempt in groups:
        key = {"run_pk": run_pk, "metric_id": metric_id, "step": step, "attempt": attempt}
        rows = conn.execute(
            sa.text(
                "SELECT mask, vals, present FROM frames WHERE run_pk = :run_pk AND metric_id = :metric_id "
                "AND step = :step AND attempt = :attempt"
            ),
            key,
        ).all()
        for mask, vals, present in rows:
            values = array("d")
            values.frombytes(vals)
            for layer in range(len(values)):
                if present is None or present[layer]:
                    # One primary-key probe per layer (head -1: the layer value).
                    stored = conn.execute(
                        sa.text(
                            "SELECT value FROM points WHERE run_pk = :run_pk AND metric_id = :metric_id AND head = -1 "
                            "AND layer = :layer AND step = :step AND attempt = :attempt"
                        ),
                        {**key, "layer": layer},
                    ).first()
                    if stored is not None:
                        values[layer] = math.nan if stored[0] is None else stored[0]
            has_nan = any(math.isnan(v) for i, v in enumerate(values) if present is None or present[i])
            conn.execute(
                sa.text(
                    "UPDATE frames SET vals = :vals, has_nan = :has_nan "
                    "WHERE run_pk = :run_pk AND metric_id = :metric_id "
                    "AND step = :step AND attempt = :attempt AND mask = :mask"
                ),
                {**key, "mask": mask, "vals": values.tobytes(), "has_nan": has_nan},
            )
