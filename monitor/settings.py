"""The collector's settings: one pydantic-settings object, read once and passed in.

Every field can be set by an environment variable ``QKWATCH_<FIELD>`` (e.g.
``QKWATCH_DATABASE_URL``); an explicit argument wins over the environment, which wins over the
default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from qkwatch.monitor.thresholds import COLLAPSE_THRESHOLD, H_STAR, Thresholds

DEFAULT_DATABASE_URL = "sqlite:///qkwatch.db"


class Settings(BaseSettings):
    """Collector configuration (env prefix ``QKWATCH_``)."""

    model_config = SettingsConfigDict(env_prefix="QKWATCH_", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL: ``sqlite:///path.db`` (embedded) or ``postgresql+psycopg://...``."""
    open_access: bool = False
    """Skip authentication (``qkwatch serve --open``); only allowed on a loopback host."""
    metrics_public: bool = False
    """Serve ``GET /metrics`` without a token (scrape over a trusted network); else it needs a read token,
    and shows only that token's project. Open access implies it."""
    auto_migrate: bool = True
    """Apply the Alembic migrations when the app starts."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    """Request bodies above this get 413 before they are read whole."""
    max_points_per_batch: int = Field(default=250_000, gt=0)
    """A report batch with more points than this gets 413."""
    max_reports_per_batch: int = Field(default=10_000, gt=0)
    """A report batch with more reports than this gets 413."""
    stale_timeout_s: float = Field(default=900.0, gt=0)
    """A running run without reports (or updates) for this long is marked crashed."""
    maintenance_interval_s: float = Field(default=30.0, gt=0)
    """How often the stale-run heartbeat, retention and webhook retries run."""
    retention_days: float | None = Field(default=None, gt=0)
    """Delete finished and crashed runs (and their points) this long after their last update."""
    alert_rules_file: Path | None = None
    """YAML file of alert rules and webhooks; None uses the default rules."""
    webhook_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Alertmanager-format webhook receivers (added to those of the rules file)."""
    webhook_max_attempts: int = Field(default=8, ge=1)
    """Delivery attempts per alert notification before it is given up (and logged)."""
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    rate_limit_per_s: float = Field(default=200.0, gt=0)
    """Sustained requests per second per token, across all workers and replicas on the database."""
    rate_limit_burst: int = Field(default=400, ge=1)
    """Requests a token may make at once before the sustained rate applies."""
    metrics_max_runs: int = Field(default=50, ge=0)
    """At most this many active runs are exported on /metrics (the most recently updated)."""
    metrics_max_layers: int = Field(default=256, ge=1)
    """Layers above this index are not exported on /metrics (bounded series count)."""
    metrics_max_ranks: int = Field(default=64, ge=1)
    """Agent health series of ranks at or above this are not exported on /metrics (counted in
    ``qkwatch_run_series_dropped``)."""
    metrics_max_series_per_run: int = Field(default=2000, ge=1)
    """At most this many layer and scalar series per run on /metrics, layers first (beside the run's
    own gauges); the rest are counted in ``qkwatch_run_series_dropped``."""
    collapse_threshold: float = Field(default=COLLAPSE_THRESHOLD, gt=0, lt=1)
    """QKAI above this is collapse (``monitor.thresholds``): the default alert rules, the layers counted in
    ``qkwatch_collapsed_layers`` and the band, the live page's colour break and ``qkwatch report``."""
    h_star: float = Field(default=H_STAR, gt=0, lt=1)
    """Target normalised attention entropy H* (``monitor.thresholds``), served to the page and report; the
    schedule's default H* reads the same ``QKWATCH_H_STAR``."""
    sqlite_busy_timeout_ms: int = Field(default=10_000, ge=0)
    background: bool = True
    """Run the maintenance and webhook threads (tests drive them by hand)."""
    external_url: str = "http://127.0.0.1:8000"
    """Base URL used in webhook payloads' links."""

    @property
    def thresholds(self) -> Thresholds:
        """The collapse threshold and H* as one validated value."""
        return Thresholds(self.collapse_threshold, self.h_star)

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):  # QKWATCH_WEBHOOK_URLS="http://a,http://b"
            return [u.strip() for u in value.split(",") if u.strip()]
        return value
