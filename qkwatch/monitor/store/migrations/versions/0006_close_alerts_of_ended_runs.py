"""Alerts of runs that had already ended are closed, as the collector now closes them when a run ends.

Before this revision a run marked finished or crashed kept its firing alerts for good. Now a run's
end resolves them (``monitor.alerting.evaluator.end_of_run``); this revision does the same for the
runs that ended before it: each firing alert of a finished or crashed run resolves at the run's
last step and time, with "(closed: the run <status>)" added to its summary, and the run's rule
streaks start over. No notification is sent for these (they may be months old). The downgrade
leaves the alerts resolved.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-14 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ENDED = "SELECT pk FROM runs WHERE status IN ('finished', 'crashed')"


def upgrade() -> None:
    conn = op.get_bind()
    conn.execute(
        sa.text(f"""
        UPDATE alerts SET
            state = 'resolved',
            resolved_step = (SELECT last_step FROM runs WHERE runs.pk = alerts.run_pk),
            ends_at = (SELECT updated_at FROM runs WHERE runs.pk = alerts.run_pk),
            summary = summary || ' (closed: the run '
                      || (SELECT status FROM runs WHERE runs.pk = alerts.run_pk) || ')'
        WHERE state = 'firing' AND run_pk IN ({ENDED})""")
    )
    conn.execute(
        sa.text(f"""
        UPDATE alert_state SET alert_id = NULL, streak = 0, since_step = NULL, band_layers = '[]'
        WHERE run_pk IN ({ENDED})""")
    )


def downgrade() -> None:
    pass  # the alerts stay resolved: they were about runs that had ended
