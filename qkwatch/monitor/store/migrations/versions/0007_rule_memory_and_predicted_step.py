"""Alert rules remember values per layer; a forecast's alert keeps its predicted crossing step.

``alert_state.memory`` (JSON text, nullable): what a growth rule (its layer's early values) or a
forecast rule (its layer's recent points) carries from one batch to the next; NULL for threshold
and band rules. ``alerts.predicted_step`` (nullable): the step at which a forecast rule predicted,
when it fired, that the metric would cross its threshold, so that a forecast can be scored against
the step it really crossed; NULL for the other kinds. The view ``qkwatch_alerts_v`` (0004) gains
``predicted_step`` as its last column (PostgreSQL's CREATE OR REPLACE VIEW keeps the grants).

The downgrade drops both columns, and the view's column with them: SQLite's batch mode (copy,
drop, rename) refuses while a view reads the table, so the view is dropped first and made again
as 0004 made it (with its grant on PostgreSQL).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-20 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

ROLE = "qkwatch_grafana"

_ALERTS_V = """
        SELECT r.project, r.name AS run_name, r.id AS run_id, a.id AS alert_id, a.rule, a.severity, a.state,
               a.metric, a.layers, a.summary, a.onset_step, a.resolved_step, a.starts_at, a.ends_at{extra}
        FROM alerts a
        JOIN runs r ON r.pk = a.run_pk"""

_GRANT = f"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
        GRANT SELECT ON qkwatch_alerts_v TO {ROLE};
    END IF;
END
$$"""


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    op.add_column("alert_state", sa.Column("memory", sa.Text(), nullable=True))
    op.add_column("alerts", sa.Column("predicted_step", sa.BigInteger(), nullable=True))
    view = _ALERTS_V.format(extra=", a.predicted_step").strip()
    if _postgres():
        op.execute(f"CREATE OR REPLACE VIEW qkwatch_alerts_v AS {view}")
    else:
        op.execute("DROP VIEW IF EXISTS qkwatch_alerts_v")
        op.execute(f"CREATE VIEW qkwatch_alerts_v AS {view}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS qkwatch_alerts_v")
    with op.batch_alter_table("alerts") as batch_op:
        batch_op.drop_column("predicted_step")
    with op.batch_alter_table("alert_state") as batch_op:
        batch_op.drop_column("memory")
    op.execute(f"CREATE VIEW qkwatch_alerts_v AS {_ALERTS_V.format(extra='').strip()}")
    if _postgres():
        op.execute(_GRANT)
