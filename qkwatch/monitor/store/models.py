"""Database tables (SQLAlchemy Core) and the row classes the store hands upwards.

An alert is the contract's :class:`qkwatch.contract.responses.AlertPublic` (made in
``alerts.alert_public``), and a queued notification of one (``PendingNotification``) lives in
``alerting``, which formats it and must not import the store. The token, event, lambda and
ingest rows live with the store module that makes them (``tokens``, ``events``, ``lambdas``, ``ingest``).

Points carry no surrogate key: their natural key (run, metric id, head, step, layer, attempt) is
the primary key, ordered so that a batch's points of one metric are written together and a
heatmap (all layers of one metric) is an index range scan; one layer over many steps is read from
the frames. ``head`` is -1 for a layer value; ``layer`` is -1 for a run-level scalar.
A NaN value is stored as SQL NULL on both databases (SQLite turns a bound NaN into NULL anyway;
"not measured" is never stored, so NULL is unambiguous); infinities are stored as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from qkwatch.contract.wire import RunConfig

metadata = sa.MetaData()

# Names compared in the big indexes use the "C" collation on PostgreSQL: byte order, no locale
# rules, much cheaper comparisons (SQLite's default BINARY collation is the same already).
Name = sa.String(128).with_variant(sa.String(128, collation="C"), "postgresql")

LAYER_VALUE = -1
"""``head`` of a layer-level point."""
RUN_SCALAR = -1
"""``layer`` (and ``head``) of a run-level scalar point."""

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("pk", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("project", sa.String(200), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("status_reason", sa.String(200)),  # contract.wire.STATUS_REASON_MAX
    sa.Column("config", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("last_report_at", sa.Float),
    sa.Column("last_step", sa.BigInteger),
    sa.Column("latest_attempt", sa.Integer, nullable=False),
    sa.Column("lambda_version", sa.Integer, nullable=False),
    sa.Column("lambda_step", sa.BigInteger),
    sa.Column("notes", sa.Text),  # free text, at most contract.wire.MAX_NOTES_BYTES (migration 0009)
    sa.UniqueConstraint("project", "name", name="uq_runs_project_name"),
    sa.Index("ix_runs_status_updated", "status", "updated_at"),
)

run_tags = sa.Table(
    # A run's tags, one row each (migration 0009). The primary key answers "the tags of these runs";
    # the index answers "the runs with this tag" (a search by tags).
    "run_tags",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("tag", sa.String(64), primary_key=True),  # contract.wire.TAG_PATTERN
    sa.Index("ix_run_tags_tag", "tag", "run_pk"),
)

attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("attempt_key", sa.String(200)),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.UniqueConstraint("run_pk", "attempt_key", name="uq_attempts_key"),
)

batches = sa.Table(
    "batches",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("batch_id", sa.String(36), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("points", sa.Integer, nullable=False),
    sa.Column("received_at", sa.Float, nullable=False),
)

metric_names = sa.Table(
    # Points and frames carry a small integer instead of the metric's name: a narrower primary
    # key makes every insert cheaper (about 40 % on PostgreSQL). A name no run uses any more is
    # deleted (``monitor.store.metric_names.reclaim``), so an id is only ever read in the
    # transaction that uses it, never cached.
    "metric_names",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", Name, nullable=False, unique=True),
)

run_metrics = sa.Table(
    # The metric names each run has stored points of (migration 0010): a row per (run, name), added by
    # the ingest that first stores the name for the run, deleted with the run. It counts a run's names
    # (the per-run limit) and tells the names no run uses from those in use without reading points. The
    # foreign key keeps a name in use from being deleted and a deleted id from being used (both fail
    # loudly); a rebuild that renumbers the ids carries these rows along (ON UPDATE CASCADE).
    "run_metrics",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column(
        "metric_id",
        sa.Integer,
        sa.ForeignKey("metric_names.id", name="fk_run_metrics_metric_id", onupdate="CASCADE"),
        primary_key=True,
    ),
    sa.Index("ix_run_metrics_metric_id", "metric_id"),
)

points = sa.Table(
    "points",
    metadata,
    sa.Column("run_pk", sa.Integer, nullable=False),
    sa.Column("metric_id", sa.Integer, nullable=False),
    sa.Column("head", sa.Integer, nullable=False),
    sa.Column("layer", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("value", sa.Double),
    # Step before layer (migration 0011): a batch's points of one metric lie together at the end of
    # the run's range, so a batch writes a few pages per metric, not one per layer. One layer over
    # many steps is read from the frames (reads.series).
    sa.PrimaryKeyConstraint("run_pk", "metric_id", "head", "step", "layer", "attempt"),
    sqlite_with_rowid=False,
)
RUN_SCALARS = (
    points.c.head == sa.literal_column(str(LAYER_VALUE)),
    points.c.layer == sa.literal_column(str(RUN_SCALAR)),
)
"""The run scalars among the points (a loss, a health value): the conditions of ``ix_points_run_scalars``,
and what every read of scalars puts in its WHERE. Constants, not bound parameters, so that both
databases' planners can prove a query's conditions the index's (PostgreSQL's generic plans could not)."""
# The run scalars (migration 0012): under the key above a metric's scalars (layer -1) lie one per step
# among its layer values, so reading them scanned every layer value of the metric. A partial index
# keeps them apart, covering (the value is in it). Its key repeats head and layer so that a query on
# (run, metric, head, layer) matches more of its columns than of the primary key's, which is how
# SQLite's planner, with no statistics, chooses it (tests/monitor/store/test_run_scalars.py).
sa.Index(
    "ix_points_run_scalars",
    points.c.run_pk,
    points.c.metric_id,
    points.c.head,
    points.c.layer,
    points.c.step,
    points.c.attempt,
    points.c.value,
    sqlite_where=sa.and_(*RUN_SCALARS),
    postgresql_where=sa.and_(*RUN_SCALARS),
)

frames = sa.Table(
    # One row per (report, metric): the layer values as one float64 array, so that a heatmap
    # reads one row per step instead of one per layer. ``mask`` tells apart reports of one step
    # that carry different layers (layers shared out over ranks): "a<n>" when all n are present,
    # else a digest of ``present`` (one byte per layer, 1 = measured). NaN and infinities are
    # kept as such in ``vals``; a missing layer is NaN there and 0 in ``present``.
    "frames",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("metric_id", sa.Integer, primary_key=True),
    sa.Column("step", sa.BigInteger, primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("mask", sa.String(24), primary_key=True),
    sa.Column("vals", sa.LargeBinary, nullable=False),
    sa.Column("present", sa.LargeBinary),
    sa.Column("has_nan", sa.Boolean, nullable=False),
    sqlite_with_rowid=False,
)

latest = sa.Table(
    "latest",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("metric", sa.String(128), primary_key=True),
    sa.Column("layer", sa.Integer, primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("value", sa.Double),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("step", sa.BigInteger, primary_key=True),
    sa.Column("kind", sa.String(128), primary_key=True),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
)

lambda_state = sa.Table(
    "lambda_state",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("layer", sa.Integer, primary_key=True),
    sa.Column("h", sa.Double),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
)

lambda_overrides = sa.Table(
    "lambda_overrides",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("layer", sa.Integer, primary_key=True),
    sa.Column("value", sa.Double, nullable=False),
)

lambda_audit = sa.Table(
    "lambda_audit",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_pk", sa.Integer, nullable=False, index=True),
    sa.Column("layer", sa.Integer, nullable=False),
    sa.Column("old", sa.Double),
    sa.Column("new", sa.Double),
    sa.Column("who", sa.String(200), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("step", sa.BigInteger),
    sa.Column("version", sa.Integer, nullable=False),
)

alert_state = sa.Table(
    "alert_state",
    metadata,
    sa.Column("run_pk", sa.Integer, primary_key=True),
    sa.Column("rule", sa.String(128), primary_key=True),
    sa.Column("layer", sa.Integer, primary_key=True),
    sa.Column("streak", sa.Integer, nullable=False),
    sa.Column("since_step", sa.BigInteger),
    sa.Column("band_layers", sa.Text),
    sa.Column("alert_id", sa.Integer),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("memory", sa.Text),  # JSON: a growth or forecast rule's per-layer values (migration 0007)
)

alerts = sa.Table(
    "alerts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("run_pk", sa.Integer, nullable=False),
    sa.Column("rule", sa.String(128), nullable=False),
    sa.Column("severity", sa.String(32), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("layers", sa.Text, nullable=False),
    sa.Column("metric", sa.String(128), nullable=False),
    sa.Column("summary", sa.Text, nullable=False),
    sa.Column("onset_step", sa.BigInteger, nullable=False),
    sa.Column("resolved_step", sa.BigInteger),
    sa.Column("starts_at", sa.Float, nullable=False),
    sa.Column("ends_at", sa.Float),
    sa.Column("predicted_step", sa.BigInteger),  # a forecast's predicted crossing step (migration 0007)
    # An alert whose run ended while it fired (state "ended", migration 0008): the run's last step,
    # how it ended (finished, crashed, stale) and the metric's last value on each of its layers (JSON).
    sa.Column("ended_step", sa.BigInteger),
    sa.Column("run_end", sa.String(16)),
    sa.Column("last_values", sa.Text),
    sa.Index("ix_alerts_run_state", "run_pk", "state"),
)

notifications = sa.Table(
    "alert_notifications",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("alert_id", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_try_at", sa.Float, nullable=False),
    sa.Column("claimed_until", sa.Float),
    sa.Column("delivered_at", sa.Float),
    sa.Column("gave_up", sa.Boolean, nullable=False),
    sa.Column("last_error", sa.Text),
    sa.Index("ix_notifications_pending", "delivered_at", "gave_up", "next_try_at"),
)

tokens = sa.Table(
    "tokens",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("project", sa.String(200), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("scopes", sa.String(200), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)


rate_buckets = sa.Table(
    # The per-token rate limit's token buckets, shared by every worker and replica on the database:
    # ``tokens`` left at ``updated_at`` (Unix seconds), refilled at the configured rate up to the burst.
    "rate_buckets",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)

# --- rows handed upwards (plain data, no session attached) ---------------------------------


@dataclass(frozen=True)
class RunRow:
    pk: int
    id: str
    project: str
    name: str
    status: str
    status_reason: str | None
    config: RunConfig
    """Parsed once, when the row is read (:func:`qkwatch.monitor.store.runs.lookup.load_config`)."""
    created_at: float
    updated_at: float
    last_report_at: float | None
    last_step: int | None
    latest_attempt: int
    lambda_version: int
    lambda_step: int | None
    tags: tuple[str, ...]
    """Sorted; read with the row (:func:`qkwatch.monitor.store.runs.lookup.run_rows`)."""
    notes: str | None


@dataclass(frozen=True)
class Series:
    steps: list[int]
    values: Sequence[float | None]
    mins: Sequence[float | None]
    maxs: Sequence[float | None]
    downsampled: bool


ExportRow = tuple[int, int, str, int, int, float]
"""One point as exported: (attempt, step, metric, layer, head, value); see LAYER_VALUE and RUN_SCALAR."""


@dataclass(frozen=True)
class Heatmap:
    steps: list[int]
    layers: list[int]
    values: Sequence[Sequence[float | None]]
    downsampled: bool


@dataclass(frozen=True)
class LatestRow:
    run_id: str
    run_name: str
    project: str
    metric: str
    layer: int
    step: int
    value: float
    last_report_at: float | None = None
