"""Read-only views for dashboards (Grafana), and on PostgreSQL a role that may read only them.

Dashboards query these views, never the tables behind them, so the storage layout (metric ids,
frames, attempts) can change without breaking a dashboard: a later migration that changes a
table re-creates the views with the same columns. Every view has the same columns on SQLite and
PostgreSQL. Times are Unix seconds (float), as in the tables. A point's ``value`` is NULL for a
NaN measurement ("not measured" is never stored).

``qkwatch_points_v``
    project, run_name, run_id, attempt, step, metric, layer, head, value: every stored point,
    merged over attempts the way the store's reads merge them (per run, metric, layer, head and
    step, the latest attempt that logged it wins; ``attempt`` says which one). ``layer`` -1 is a
    run-level scalar (loss, ``agent_*``), ``head`` -1 a layer value. Reports carry no per-point
    time in storage, so there is none here: history is by step.
``qkwatch_latest_v``
    project, run_name, run_id, attempt, step, metric, layer, value: the newest layer value or
    scalar of each run (what /metrics exports, for every run, not only running ones).
``qkwatch_runs_v``
    project, run_name, run_id, status, status_reason, attempt (the latest), last_step,
    created_at, updated_at, last_report_at.
``qkwatch_alerts_v``
    project, run_name, run_id, alert_id, rule, severity, state, metric, layers (a JSON list),
    summary, onset_step, resolved_step, starts_at, ends_at.
``qkwatch_events_v``
    project, run_name, run_id, attempt, step, kind, message, data (JSON), time.

On PostgreSQL the role ``qkwatch_grafana`` (NOLOGIN) is created when absent (roles belong to the
whole server, so another database may have made it already) and granted SELECT on these views
and nothing else; the views read the tables with their owner's rights. Give it a login with
``ALTER ROLE qkwatch_grafana LOGIN PASSWORD '...'``, or make a login role that inherits it:
``CREATE ROLE grafana LOGIN PASSWORD '...' IN ROLE qkwatch_grafana``. A migrating user that may
not create roles gets a notice instead of the role, and the views all the same. The downgrade
drops the views (and with them the grants) but leaves the role, which other databases may use.

A later migration that changes a table behind a view must drop the views first and create them
again afterwards: SQLite's batch mode (copy, drop, rename) and PostgreSQL's ALTER COLUMN ... TYPE
both refuse while a view reads the table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 10:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ROLE = "qkwatch_grafana"

_RUN = "r.project, r.name AS run_name, r.id AS run_id"

VIEWS = {
    "qkwatch_runs_v": f"""
        SELECT {_RUN}, r.status, r.status_reason, r.latest_attempt AS attempt, r.last_step,
               r.created_at, r.updated_at, r.last_report_at
        FROM runs r""",
    # The NOT EXISTS is the store's merged read (Store._point_filter): an index probe on the
    # points' primary key per row.
    "qkwatch_points_v": f"""
        SELECT {_RUN}, p.attempt, p.step, n.name AS metric, p.layer, p.head, p.value
        FROM points p
        JOIN runs r ON r.pk = p.run_pk
        JOIN metric_names n ON n.id = p.metric_id
        WHERE NOT EXISTS (
            SELECT 1 FROM points q
            WHERE q.run_pk = p.run_pk AND q.metric_id = p.metric_id AND q.head = p.head
              AND q.layer = p.layer AND q.step = p.step AND q.attempt > p.attempt)""",
    "qkwatch_latest_v": f"""
        SELECT {_RUN}, l.attempt, l.step, l.metric, l.layer, l.value
        FROM latest l
        JOIN runs r ON r.pk = l.run_pk""",
    "qkwatch_alerts_v": f"""
        SELECT {_RUN}, a.id AS alert_id, a.rule, a.severity, a.state, a.metric, a.layers, a.summary,
               a.onset_step, a.resolved_step, a.starts_at, a.ends_at
        FROM alerts a
        JOIN runs r ON r.pk = a.run_pk""",
    "qkwatch_events_v": f"""
        SELECT {_RUN}, e.attempt, e.step, e.kind, e.message, e.data, e.time
        FROM events e
        JOIN runs r ON r.pk = e.run_pk""",
}

# Roles are server-wide: two databases migrating at once may both find the role absent, and a
# migrating user without CREATEROLE must still get its views.
_ROLE_AND_GRANTS = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
        BEGIN
            CREATE ROLE {ROLE} NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'qkwatch: not allowed to create role {ROLE}; dashboards need another reader';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO {ROLE}', current_schema());
        GRANT SELECT ON {", ".join(VIEWS)} TO {ROLE};
    END IF;
END
$$"""


def upgrade() -> None:
    for name, select in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_ROLE_AND_GRANTS)


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
