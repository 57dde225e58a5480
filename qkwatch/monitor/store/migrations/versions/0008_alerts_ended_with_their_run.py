"""An alert still firing when its run ends is "ended", not resolved, and keeps its last values.

Before this revision the end of a run (finished, crashed, or marked crashed as stale) resolved its
firing alerts at the run's last step, adding "(closed: the run <status>)" to their summaries
(``end_of_run``, and revision 0006 for the runs that had ended before it). That read as healed
while the layer's QKAI might still be 0.93. Now such an alert keeps state ``ended``, with three new
columns of ``alerts`` (all nullable):

``ended_step``
    the run's last step when it ended;
``run_end``
    how it ended: ``finished``, ``crashed`` or ``stale``;
``last_values``
    JSON, the alert's metric on each of its ``layers`` (same order) at the run's end, as the wire
    encodes values (``"nan"``; null: never measured).

The rows that the old code closed this way are what they always were, alerts that were firing when
their run ended, and this revision says so: a ``resolved`` alert whose summary ends with the note
that code wrote (and only such a row) becomes ``ended``, its ``resolved_step`` (the run's last step
then) moves to ``ended_step``, the note leaves the summary and becomes ``run_end``; ``ends_at``
keeps the time the run ended. Their ``last_values`` stay NULL: the old code did not record them,
and the values stored since may belong to a resumed attempt, so none are made up. The
notifications those rows sent at the time ("resolved") are history and stay as they were. Their
rule states were already reset then, so a resume of such a run does not re-open them (a run ended
from now on does: see ``monitor.alerting.evaluator.end_of_run``).

The view ``qkwatch_alerts_v`` (0004, 0007) gains ``ended_step``, ``run_end`` and ``last_values`` as
its last columns (PostgreSQL's CREATE OR REPLACE VIEW keeps the grants).

The downgrade goes back to what the old code could say: an ended alert resolves at its
``ended_step`` with the old note in its summary, the rule states that pointed at it start over (the
old code takes an alert id in a rule state for a firing alert), the view is made again as 0007 made
it and the columns are dropped (SQLite's batch mode refuses while a view reads the table, hence the
order).

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-10 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

ROLE = "qkwatch_grafana"

_ALERTS_V = """
        SELECT r.project, r.name AS run_name, r.id AS run_id, a.id AS alert_id, a.rule, a.severity, a.state,
               a.metric, a.layers, a.summary, a.onset_step, a.resolved_step, a.starts_at, a.ends_at,
               a.predicted_step{extra}
        FROM alerts a
        JOIN runs r ON r.pk = a.run_pk"""
_ENDED_COLUMNS = ", a.ended_step, a.run_end, a.last_values"

_GRANT = f"""
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
        GRANT SELECT ON qkwatch_alerts_v TO {ROLE};
    END IF;
END
$$"""

NOTES = {"finished": "finished", "crashed": "crashed", "stale": "crashed (stale)"}
"""``run_end`` -> the run's status as the old note named it: " (closed: the run <this>)"."""


def _note(status: str) -> str:
    return f" (closed: the run {status})"


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def _make_view(extra: str) -> None:
    view = _ALERTS_V.format(extra=extra).strip()
    if _postgres():
        op.execute(f"CREATE OR REPLACE VIEW qkwatch_alerts_v AS {view}")
    else:
        op.execute("DROP VIEW IF EXISTS qkwatch_alerts_v")
        op.execute(f"CREATE VIEW qkwatch_alerts_v AS {view}")


def upgrade() -> None:
    op.add_column("alerts", sa.Column("ended_step", sa.BigInteger(), nullable=True))
    op.add_column("alerts", sa.Column("run_end", sa.String(length=16), nullable=True))
    op.add_column("alerts", sa.Column("last_values", sa.Text(), nullable=True))
    conn = op.get_bind()
    for run_end, status in NOTES.items():
        note = _note(status)  # no LIKE wildcard (% or _) in any of them
        conn.execute(
            sa.text("""
            UPDATE alerts SET
                state = 'ended',
                ended_step = resolved_step,
                resolved_step = NULL,
                run_end = :run_end,
                summary = substr(summary, 1, length(summary) - :n)
            WHERE state = 'resolved' AND summary LIKE :pattern"""),
            {"run_end": run_end, "n": len(note), "pattern": f"%{note}"},
        )
    _make_view(_ENDED_COLUMNS)


def downgrade() -> None:
    conn = op.get_bind()
    conn.execute(
        sa.text("""
        UPDATE alert_state SET alert_id = NULL, streak = 0, since_step = NULL, band_layers = '[]'
        WHERE alert_id IN (SELECT id FROM alerts WHERE state = 'ended')""")
    )
    for run_end, status in NOTES.items():
        conn.execute(
            sa.text("""
            UPDATE alerts SET state = 'resolved', resolved_step = ended_step, summary = summary || :note
            WHERE state = 'ended' AND run_end = :run_end"""),
            {"run_end": run_end, "note": _note(status)},
        )
    conn.execute(  # an ended row without a known run_end (none is written so): resolved, with what it says
        sa.text("""
        UPDATE alerts SET state = 'resolved', resolved_step = ended_step,
            summary = summary || ' (closed: the run ended)'
        WHERE state = 'ended'""")
    )
    op.execute("DROP VIEW IF EXISTS qkwatch_alerts_v")
    with op.batch_alter_table("alerts") as batch_op:
        batch_op.drop_column("last_values")
        batch_op.drop_column("run_end")
        batch_op.drop_column("ended_step")
    op.execute(f"CREATE VIEW qkwatch_alerts_v AS {_ALERTS_V.format(extra='').strip()}")
    if _postgres():
        op.execute(_GRANT)
