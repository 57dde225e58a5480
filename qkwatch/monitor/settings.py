"""The collector's settings: one pydantic-settings object, read once and passed in.

Every field can be set by an environment variable ``QKWATCH_<FIELD>`` (e.g.
``QKWATCH_DATABASE_URL``); an explicit argument wins over the environment, which wins over the
default. Every value is checked when the settings are read: numbers finite and in range, URLs
http(s), nothing empty that needs a value. :func:`load_settings` turns a refusal into one line
naming the variable and the value (``qkwatch serve``, ``db`` and ``token`` print it and exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, H_STAR, Thresholds
from qkwatch.contract.urls import brief as _brief
from qkwatch.contract.urls import check_http_url

DEFAULT_DATABASE_URL = "sqlite:///qkwatch.db"
ENV_PREFIX = "QKWATCH_"
MAX_COUNT = 2**31 - 1
"""Largest whole-number setting: a 32-bit signed integer, which every integer column, SQL ``LIMIT`` and driver
timeout takes."""
MAX_SECONDS = 1e9
"""Longest duration setting (about 31 years); a timer or a date computed from a longer one can overflow."""


Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]


HttpURL = Annotated[str, AfterValidator(check_http_url)]
"""An http(s) URL with a host (:func:`check_http_url`)."""


class Settings(BaseSettings):
    """Collector configuration (env prefix ``QKWATCH_``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL: ``sqlite:///path.db`` (embedded) or ``postgresql+psycopg://...``."""
    open_access: bool = False
    """Skip authentication (``qkwatch serve --open``); only allowed on a loopback host."""
    metrics_public: bool = False
    """Serve ``GET /metrics`` without a token (scrape over a trusted network); else it needs a read token,
    and shows only that token's project. Open access implies it."""
    auto_migrate: bool = True
    """Apply the Alembic migrations when the app starts."""
    max_body_bytes: Count = 4 * 1024 * 1024
    """Request bodies above this get 413 before they are read whole."""
    max_points_per_batch: Count = 250_000
    """A report batch with more points than this gets 413."""
    max_reports_per_batch: Count = 10_000
    """A report batch with more reports than this gets 413."""
    max_metric_names_per_run: Count = 1000
    """Distinct metric names (layer, per-head and scalar metrics together) one run may have; a batch that
    would take a run past it gets 422 and is not stored."""
    stale_timeout_s: Seconds = 900.0
    """A running run without reports (or updates) for this long is marked crashed."""
    maintenance_interval_s: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] = 30.0
    """How often the stale-run heartbeat, retention and webhook retries run (at most a day)."""
    retention_days: Annotated[float, Field(gt=0, le=36_500, allow_inf_nan=False)] | None = None
    """Delete finished and crashed runs (and their points) this long after their last update (at most 100 years)."""
    alert_rules_file: Path | None = None
    """YAML file of alert rules and webhooks; None uses the default rules."""
    webhook_urls: Annotated[list[HttpURL], NoDecode] = Field(default_factory=list)
    """Alertmanager-format webhook receivers (added to those of the rules file), http(s) URLs."""
    webhook_max_attempts: Count = 8
    """Delivery attempts per alert notification before it is given up (and logged)."""
    webhook_timeout_s: Annotated[float, Field(gt=0, le=3_600, allow_inf_nan=False)] = 5.0
    """Seconds one webhook delivery may take in all, its answer read (at most an hour)."""
    webhook_allow_private: bool = False
    """Let webhooks reach loopback, private, link-local (metadata) and other non-public addresses; off,
    such a target is refused at every delivery (``qkwatch.monitor.alerting.webhooks``)."""
    webhook_secret: SecretStr | None = None
    """Sign every webhook body: ``X-Qkwatch-Signature: sha256=HMAC(secret, "<X-Qkwatch-Timestamp>.<body>")``."""
    webhook_max_response_bytes: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 64 * 1024
    """A receiver's answer longer than this is cut off and the delivery counted as failed."""
    rate_limit_per_s: Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)] = 200.0
    """Sustained requests per second per token, across all workers and replicas on the database."""
    rate_limit_burst: Count = 400
    """Requests a token may make at once before the sustained rate applies."""
    metrics_max_runs: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 50
    """At most this many active runs are exported on /metrics (the most recently updated)."""
    metrics_max_layers: Count = 256
    """Layers above this index are not exported on /metrics (bounded series count)."""
    metrics_max_ranks: Count = 64
    """Agent health series of ranks at or above this are not exported on /metrics (counted in
    ``qkwatch_run_series_dropped``)."""
    metrics_max_series_per_run: Count = 2000
    """At most this many layer and scalar series per run on /metrics, layers first (beside the run's
    own gauges); the rest are counted in ``qkwatch_run_series_dropped``."""
    collapse_threshold: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = COLLAPSE_THRESHOLD
    """QKAI above this is collapse (``contract.thresholds``): the default alert rules, the layers counted in
    ``qkwatch_collapsed_layers`` and the band, the live page's colour break and ``qkwatch report``."""
    h_star: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = H_STAR
    """Target normalised attention entropy H* (``contract.thresholds``), served to the page and report; the
    schedule's default H* reads the same ``QKWATCH_H_STAR``."""
    sqlite_busy_timeout_ms: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 10_000
    """How long a SQLite writer waits for the lock before it fails."""
    background: bool = True
    """Run the maintenance and webhook threads (tests drive them by hand)."""
    external_url: HttpURL = "http://127.0.0.1:8000"
    """Base URL used in webhook payloads' links, http(s)."""

    @property
    def thresholds(self) -> Thresholds:
        """The collapse threshold and H* as one validated value."""
        return Thresholds(self.collapse_threshold, self.h_star)

    @field_validator("webhook_secret")
    @classmethod
    def _long_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("a webhook secret is at least 16 characters (a shorter one is guessed)")
        return value

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):  # QKWATCH_WEBHOOK_URLS="http://a,http://b"
            return [u.strip() for u in value.split(",") if u.strip()]
        return value

    @field_validator("database_url", "alert_rules_file", mode="before")
    @classmethod
    def _not_empty(cls, value: object) -> object:
        # An empty variable (QKWATCH_DATABASE_URL=) is a mistake, not a wish for the default: a collector that
        # quietly wrote to ./qkwatch.db instead of the intended PostgreSQL would lose its data with the container.
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty; leave it out for the default")
        return value


class SettingError(ValueError):
    """A setting that cannot be used, as one line: where it came from, its value, and what is wrong."""


def load_settings(flags: Mapping[str, str] | None = None, **values: Any) -> Settings:
    """``Settings(**values)``, with a refusal as one line naming the setting and the value.

    Args:
        flags: for a field given by a command-line flag, the flag (``{"database_url": "--database-url"}``):
            the message names it instead of the variable.
        values: explicit values (over ``QKWATCH_*`` over the defaults).

    Raises:
        SettingError: e.g. ``QKWATCH_COLLAPSE_THRESHOLD='nan': Input should be a finite number``.
    """
    try:
        return Settings(**values)
    except ValidationError as exc:
        raise SettingError(describe(exc, flags or {})) from None


def describe(exc: ValidationError, flags: Mapping[str, str]) -> str:
    """The first error of a ``Settings`` validation as one line: ``WHERE=VALUE: what is wrong``."""
    errors = exc.errors()
    error = errors[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    where = flags.get(field) or f"{ENV_PREFIX}{field.upper()}"
    value = error.get("input")
    message = str(error["msg"]).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    shown = "'***'" if field in SECRETS else _brief(value)  # a secret is never written to a log
    return f"{where}={shown}: {message}{more}"


SECRETS = frozenset({"webhook_secret"})
"""Settings whose value an error message hides."""
