"""The store: the only code that knows SQL. Batch-first; every method is one transaction.

:class:`Store` is a facade: each method opens one transaction (:mod:`qkwatch.monitor.store.transactions`,
which owns the engine) and hands its connection to the module of its concern:

* the runs (:mod:`qkwatch.monitor.store.runs`): :mod:`~qkwatch.monitor.store.runs.lifecycle` (runs
  start, resume, end, go away) and :mod:`~qkwatch.monitor.store.runs.lookup` (runs by id, name,
  filters); :mod:`~qkwatch.monitor.store.runs.alerts` (alerts and the notification outbox),
  :mod:`~qkwatch.monitor.store.runs.lambdas` (running entropies, overrides, audit),
  :mod:`~qkwatch.monitor.store.runs.events`;
* the values (:mod:`qkwatch.monitor.store.values`): :mod:`~qkwatch.monitor.store.values.ingest` (a
  batch of reports, with its schedule state and alerts), :mod:`~qkwatch.monitor.store.values.reads`
  and :mod:`~qkwatch.monitor.store.values.history` (series, heatmaps, history, export);
* :mod:`qkwatch.monitor.store.tokens` and :mod:`qkwatch.monitor.store.metric_names`.

A route that reads a run and then its values takes one read transaction for all of them with
:meth:`Store.snapshot` (:class:`~qkwatch.monitor.store.transactions.Snapshot`).

Errors the API turns into 4xx are raised as :class:`NotFound` and :class:`Invalid`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

import sqlalchemy as sa

from qkwatch.contract.responses import AlertPublic
from qkwatch.contract.wire import ReportBatch, RunCreate, RunPatch
from qkwatch.monitor.alerting.records import PendingNotification
from qkwatch.monitor.store import metric_names, tokens
from qkwatch.monitor.store import models as m
from qkwatch.monitor.store.errors import Invalid, NotFound
from qkwatch.monitor.store.runs import alerts, events, lambdas, lifecycle, lookup
from qkwatch.monitor.store.runs.lambdas import CLIP_WHO
from qkwatch.monitor.store.runs.lookup import TERMINAL
from qkwatch.monitor.store.tokens import hash_token
from qkwatch.monitor.store.transactions import Transactions
from qkwatch.monitor.store.values import history, ingest, reads
from qkwatch.rules.ruleset import RuleSet

logger = logging.getLogger(__name__)

__all__ = ["CLIP_WHO", "TERMINAL", "Invalid", "NotFound", "Store", "hash_token"]


def _now(now: float | None) -> float:
    return time.time() if now is None else now


class Store(Transactions):
    """All database access of the collector."""

    # --- runs -------------------------------------------------------------------------------

    def create_or_resume_run(self, body: RunCreate, now: float | None = None) -> tuple[m.RunRow, int]:
        """Create the run or resume it; returns the run and the attempt to report under.

        See :func:`qkwatch.monitor.store.runs.lifecycle.create_or_resume`.
        """
        with self._write() as conn:
            return lifecycle.create_or_resume(conn, body, _now(now))

    def get_run(self, run_id: str) -> m.RunRow:
        """The run ``run_id``.

        Raises:
            NotFound: no such run.
        """
        with self.snapshot() as s:
            return s.get_run(run_id)

    def get_run_by_name(self, project: str, name: str) -> m.RunRow:
        """The run ``project/name``.

        Raises:
            NotFound: no such run.
        """
        with self.snapshot() as s:
            return s.get_run_by_name(project, name)

    def list_runs(
        self,
        *,
        projects: Sequence[str] | None,
        status: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[m.RunRow], int]:
        """Runs matching the filters (``projects`` None = all; ``tags``: each of them), newest activity
        first, and their count."""
        with self._read() as conn:
            return lookup.page(conn, lookup.basic_filters(projects, status, name, tags), limit, offset)

    def search_runs(
        self,
        *,
        projects: Sequence[str] | None,
        status: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        created: tuple[float | None, float | None] = (None, None),
        updated: tuple[float | None, float | None] = (None, None),
        ever_above: tuple[str, float] | None = None,
        latest_above: tuple[str, float] | None = None,
        alerts: Sequence[tuple[Sequence[str], bool]] = (),
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[m.RunRow], int]:
        """Runs matching every filter given, newest activity first, and their count.

        Args:
            projects: the projects to look in; None = all.
            tags: the run has every one of them.
            created, updated: (after, before) bounds in epoch seconds, inclusive; None = open.
            ever_above: (metric, x): some layer value or scalar of ``metric``, at any step of any
                attempt, was above x (NaN never is; +inf always is).
            latest_above: (metric, x): the latest value of some layer (or the scalar) is above x.
            alerts: (rule names, wanted) pairs: the run has (wanted True) or has not (False) had
                an alert, firing or resolved, of one of the rules.
        """
        with self._read() as conn:
            where = lookup.basic_filters(projects, status, name, tags) + lookup.search_filters(
                conn,
                created=created,
                updated=updated,
                ever_above=ever_above,
                latest_above=latest_above,
                alerts=alerts,
            )
            return lookup.page(conn, where, limit, offset)

    def set_status(
        self, run_id: str, status: str, reason: str | None = None, attempt: int | None = None, now: float | None = None
    ) -> m.RunRow:
        """Set how the run ended (idempotent); see :func:`qkwatch.monitor.store.runs.lifecycle.set_status`.

        Raises:
            NotFound: unknown run. Invalid: an attempt the run does not have.
        """
        with self._write() as conn:
            return lifecycle.set_status(conn, run_id, status, reason, attempt, _now(now))

    def patch_run(self, run_id: str, body: RunPatch, now: float | None = None) -> m.RunRow:
        """Set the run's tags, notes and status, all or nothing; see :func:`qkwatch.monitor.store.runs.lifecycle.patch`.

        Raises:
            NotFound: unknown run. Invalid: too many tags, or an attempt the run does not have.
        """
        with self._write() as conn:
            return lifecycle.patch(conn, run_id, body, _now(now))

    def delete_run(self, run_id: str) -> None:
        """Delete the run and all its rows (see :func:`qkwatch.monitor.store.runs.lifecycle.delete`), then the
        metric names no run uses any more.

        Raises:
            NotFound: unknown run.
        """
        with self._write() as conn:
            lifecycle.delete(conn, lookup.locked(conn, run_id).pk)
        self._reclaim_after_delete()

    def mark_stale(self, timeout_s: float, now: float | None = None) -> list[str]:
        """Mark running runs without reports (or updates) for ``timeout_s`` as crashed; returns their ids."""
        with self._write() as conn:
            return lifecycle.mark_stale(conn, timeout_s, _now(now))

    def apply_retention(self, days: float, now: float | None = None) -> list[str]:
        """Delete finished and crashed runs not updated for ``days``, then the metric names no run uses
        any more; returns the runs' ids."""
        with self._write() as conn:
            gone = lifecycle.apply_retention(conn, days, _now(now))
        if gone:
            self._reclaim_after_delete()
        return gone

    def _reclaim_after_delete(self) -> None:
        # Best effort: the runs are gone whatever happens here, and the maintenance pass reclaims
        # what this could not (a database that went away between the two transactions).
        try:
            self.reclaim_metric_names()
        except sa.exc.DBAPIError as exc:
            logger.warning(
                "metric names not reclaimed after a run's deletion (the next maintenance pass will): %s", exc
            )

    def reclaim_metric_names(self) -> int:
        """Delete the metric names no run uses (their ids may be given again); returns how many.

        Its own transaction, which never waits for an ingest: see :mod:`qkwatch.monitor.store.metric_names`.
        """
        with self._write() as conn:
            return metric_names.reclaim(conn)

    # --- ingest -----------------------------------------------------------------------------

    def add_reports(
        self,
        run_id: str,
        batch: ReportBatch,
        rules: RuleSet,
        now: float | None = None,
        *,
        max_metric_names: int | None = None,
        allow: Callable[[m.RunRow], None] | None = None,
    ) -> ingest.IngestResult:
        """Store a batch whole or not at all, exactly once (batch id + natural key of each point).

        In the same transaction the batch's metric names get their ids (read there, never cached),
        the run's running entropies move and ``rules`` are evaluated (alerts opened or resolved,
        notifications queued): see :func:`qkwatch.monitor.store.values.ingest.write_batch`.

        Args:
            max_metric_names: the most distinct metric names a run may have (None: no limit).
            allow: called with the run, as locked for the write and before anything is written;
                what it raises (the caller may not write to this run) rolls the transaction back
                and propagates. The run is read once per batch, not once to check and again to write.

        Raises:
            NotFound: unknown run.
            Invalid: the batch names an attempt the run does not have, or takes the run past
                ``max_metric_names``.
        """
        now = _now(now)
        flat = ingest.flatten(batch)
        with self._write() as conn:
            return ingest.write_batch(conn, run_id, batch, flat, rules, now, max_metric_names, allow)

    # --- alerts and notifications -------------------------------------------------------------

    def list_alerts(
        self, *, projects: Sequence[str] | None, run_id: str | None = None, state: str | None = None, limit: int = 500
    ) -> list[AlertPublic]:
        with self._read() as conn:
            return alerts.select(conn, projects, run_id, state, limit)

    def claim_notifications(self, now: float, lease_s: float = 60.0, limit: int = 50) -> list[PendingNotification]:
        """Claim due notifications for delivery (a lease, so replicas do not send one twice)."""
        with self._write() as conn:
            return alerts.claim_notifications(conn, now, lease_s, limit)

    def finish_notification(
        self, nid: int, *, delivered: bool, error: str | None, next_try_at: float | None, give_up: bool, now: float
    ) -> None:
        with self._write() as conn:
            alerts.finish_notification(
                conn, nid, delivered=delivered, error=error, next_try_at=next_try_at, give_up=give_up, now=now
            )

    def notification_stats(self) -> dict[str, int]:
        with self._read() as conn:
            return alerts.notification_stats(conn)

    # --- reads ------------------------------------------------------------------------------

    def has_points(self, run: m.RunRow, metric: str, head: int) -> bool:
        """Whether the run stored any point of ``metric`` for ``head`` (-1: layer values and scalars)."""
        with self._read() as conn:
            return reads.has_points(conn, run, metric, head)

    def series(
        self,
        run: m.RunRow,
        metric: str,
        layer: int,
        *,
        head: int = m.LAYER_VALUE,
        start: int | None = None,
        end: int | None = None,
        max_points: int = 1000,
        attempt: int | None = None,
    ) -> m.Series:
        """One layer's (or a scalar's) values; more than ``max_points`` steps are bucketed keeping min and max."""
        with self._read() as conn:
            return reads.series(conn, run, metric, layer, head, start, end, max_points, attempt)

    def heatmap(
        self,
        run: m.RunRow,
        metric: str,
        *,
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 500,
        agg: str = "max",
        head: int = m.LAYER_VALUE,
        attempt: int | None = None,
    ) -> m.Heatmap:
        """All layers of one metric over steps; steps bucketed to at most ``max_steps`` by ``agg`` (max by default)."""
        with self._read() as conn:
            return reads.heatmap(conn, run, metric, start, end, max_steps, agg, head, attempt)

    def history(
        self,
        run: m.RunRow,
        metrics: Sequence[str],
        *,
        start: int | None = None,
        end: int | None = None,
        attempt: int | None = None,
        max_points: int | None = None,
    ) -> dict[str, m.Heatmap]:
        """Every layer value and run-level scalar of ``metrics``, unbucketed: per metric, steps x layers.

        See :func:`qkwatch.monitor.store.values.history.grids`.

        Raises:
            Invalid: the answer would hold more than ``max_points`` values.
        """
        with self._read() as conn:
            return history.grids(conn, run, metrics, start, end, attempt, max_points)

    def export_rows(self, run: m.RunRow, attempt: int | None = None, chunk: int = 5000) -> Iterator[m.ExportRow]:
        """Every point of the run (merged view unless ``attempt``) as (attempt, step, metric, layer, head, value)."""
        with self.engine.connect() as conn:
            yield from reads.export_rows(conn, run, attempt, chunk)

    def list_events(
        self, run: m.RunRow, *, kind: str | None = None, attempt: int | None = None, limit: int = 1000
    ) -> list[events.EventRow]:
        with self._read() as conn:
            return events.select(conn, run, kind, attempt, limit)

    def run_metrics(self, run: m.RunRow) -> dict[str, list[int]]:
        """Metric name -> layers that reported it (``[-1]`` for a run-level scalar)."""
        with self.snapshot() as s:
            return s.run_metrics(run)

    def latest_snapshot(
        self,
        metrics: Sequence[str],
        max_runs: int,
        max_layers: int,
        projects: Sequence[str] | None = None,
        prefixes: Sequence[str] = (),
    ) -> tuple[list[m.RunRow], list[m.LatestRow]]:
        """Running runs (most recently updated first, at most ``max_runs``; of ``projects``, None = all)
        and their latest values of ``metrics`` and of the metrics starting with one of ``prefixes``."""
        with self._read() as conn:
            return reads.latest_snapshot(conn, metrics, max_runs, max_layers, projects, prefixes)

    # --- lambdas ----------------------------------------------------------------------------

    def lambda_state(self, run_id: str) -> tuple[m.RunRow, lambdas.LambdaState]:
        with self._read() as conn:
            run = lookup.by_id(conn, run_id)
            return run, lambdas.state(conn, run)

    def set_overrides(
        self, run_id: str, overrides: dict[int, float | None], who: str, now: float | None = None
    ) -> tuple[m.RunRow, lambdas.LambdaState]:
        """Apply operator overrides (None removes one) after validating all of them; audited.

        Raises:
            Invalid: naming the layer and the bound, for any bad value; nothing is applied then.
        """
        with self._write() as conn:
            return lambdas.set_overrides(conn, run_id, overrides, who, _now(now))

    def lambda_audit(self, run: m.RunRow) -> list[lambdas.AuditRow]:
        with self._read() as conn:
            return lambdas.audit(conn, run)

    # --- tokens and rate limits -----------------------------------------------------------------

    def create_token(
        self, project: str, scopes: Sequence[str], name: str | None = None, now: float | None = None
    ) -> tuple[tokens.TokenRow, str]:
        """Mint a token; returns its row and the secret, which is not stored (only its sha256)."""
        with self._write() as conn:
            return tokens.create(conn, project, scopes, name, _now(now))

    def token_by_hash(self, digest: str) -> tokens.TokenRow | None:
        with self._read() as conn:
            return tokens.by_hash(conn, digest)

    def list_tokens(self) -> list[tokens.TokenRow]:
        with self._read() as conn:
            return tokens.select_all(conn)

    def revoke_token(self, token_id: str, now: float | None = None) -> bool:
        with self._write() as conn:
            return tokens.revoke(conn, token_id, _now(now))

    def take_tokens(self, key: str, want: int, rate: float, burst: int, now: float | None = None) -> tuple[int, float]:
        """Take up to ``want`` tokens from the rate-limit bucket ``key``; see :func:`.tokens.take`."""
        with self._write() as conn:
            return tokens.take(conn, key, want, rate, burst, _now(now))
