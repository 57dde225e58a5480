"""The collector's background work: stale-run heartbeat, retention, unused metric names, webhook delivery.

One named daemon thread per process runs :meth:`Maintenance.run_once` every interval, or sooner
when woken (an ingest queued a notification). Every step is idempotent, so several workers or
replicas doing it at once is harmless. Tests call ``run_once`` directly.
"""

from __future__ import annotations

import logging
import threading
import time

from qkwatch.monitor.alerting.notifier import Notifier
from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.store import Store

logger = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, store: Store, notifier: Notifier, settings: Settings) -> None:
        self.store = store
        self.notifier = notifier
        self.settings = settings
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="qkwatch-maintenance", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def run_once(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        stale = self.store.mark_stale(self.settings.stale_timeout_s, now)
        if stale:
            logger.warning(
                "marked %d run(s) crashed after %.0f s without reports: %s",
                len(stale),
                self.settings.stale_timeout_s,
                ", ".join(stale),
            )
        if self.settings.retention_days is not None:
            gone = self.store.apply_retention(self.settings.retention_days, now)
            if gone:
                logger.info("retention: deleted %d finished run(s)", len(gone))
        reclaimed = self.store.reclaim_metric_names()
        if reclaimed:
            logger.info("deleted %d metric name(s) that no run uses any more", reclaimed)
        self.notifier.deliver_pending()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # keep the heartbeat alive through a database hiccup
                logger.exception("maintenance step failed; retrying in %.0f s", self.settings.maintenance_interval_s)
            self._wake.wait(self.settings.maintenance_interval_s)
            self._wake.clear()
