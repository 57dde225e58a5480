"""runs.status_reason holds up to 200 characters (was 32): the agent says why a run ended.

A reason such as "preempted: SIGTERM at step 1200, checkpointed; continue with --resume" or
"RuntimeError: CUDA out of memory..." does not fit in 32. The downgrade cuts reasons back to 32.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch_op:
        batch_op.alter_column(
            "status_reason", existing_type=sa.String(length=32), type_=sa.String(length=200), existing_nullable=True
        )


def downgrade() -> None:
    op.execute("UPDATE runs SET status_reason = substr(status_reason, 1, 32) WHERE length(status_reason) > 32")
    with op.batch_alter_table("runs") as batch_op:
        batch_op.alter_column(
            "status_reason", existing_type=sa.String(length=200), type_=sa.String(length=32), existing_nullable=True
        )
