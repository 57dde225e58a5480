"""``create_app(settings)``: the collector's FastAPI application.

The app owns everything it starts (engine, store, registry, notifier, maintenance thread); the
lifespan starts the background work and closes it all. ``app_from_env`` is the factory uvicorn
imports when ``qkwatch serve --workers N`` runs several worker processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qkwatch.contract.responses import HealthPublic
from qkwatch.monitor.alerting.notifier import Notifier
from qkwatch.monitor.alerting.webhooks import Policy
from qkwatch.monitor.api import alerts, lambdas, queries, reports, runs
from qkwatch.monitor.api.deps import Principal, RateLimiter, metrics_viewer
from qkwatch.monitor.api.limits import BodyLimitMiddleware
from qkwatch.monitor.exposition import REJECT_REASONS, Scrape, ServiceMetrics, build_registry
from qkwatch.monitor.maintenance import Maintenance
from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.engine import DatabaseFileGone, make_engine
from qkwatch.monitor.store.migrate import head_revision, upgrade
from qkwatch.monitor.store.store import Invalid, NotFound, Store
from qkwatch.monitor.ui import routes as ui
from qkwatch.rules.ruleset import RuleSet, with_webhooks

logger = logging.getLogger(__name__)

DOCS_ASSETS = "/ui/docs-assets"
RETRY_AFTER_S = 5
"""Retry-After of a 503 while the database is away (agents retry and spool meanwhile)."""
SCHEMA_ERRORS = ("42P01", "42703")
"""PostgreSQL's undefined table and undefined column: the schema is not the one the code expects."""

try:
    __version__ = version("qkwatch")  # the distribution's, not the qkwatch package's: monitor imports nothing above it
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0"


def load_rules(settings: Settings) -> RuleSet:
    collapse = settings.collapse_threshold  # a qkai rule without a threshold takes the setting
    rules = (
        RuleSet.from_file(settings.alert_rules_file, collapse)
        if settings.alert_rules_file
        else RuleSet.default(collapse)
    )
    return with_webhooks(rules, settings.webhook_urls)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the database is migrated here when ``settings.auto_migrate``."""
    settings = settings or Settings()
    store = Store(make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms))
    if settings.auto_migrate:
        upgrade(store.engine)
    rules = load_rules(settings)
    registry, service_metrics = build_registry()
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
    policy = Policy(
        settings.webhook_timeout_s, settings.webhook_allow_private, settings.webhook_max_response_bytes, secret
    )
    notifier = Notifier(
        store,
        rules.webhooks,
        max_attempts=settings.webhook_max_attempts,
        policy=policy,
        external_url=settings.external_url,
    )
    background = Maintenance(store, notifier, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.background:
            background.start()
        try:
            yield
        finally:
            background.close()
            notifier.close()
            store.close()

    # /docs and /redoc load Swagger UI's and ReDoc's JS and CSS from the collector (FastAPI's own pages
    # take them from a CDN and stay blank offline).
    app = FastAPIOffline(
        title="qkwatch collector",
        version=__version__,
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
        description="Stores per-layer query-key diagnostics of training runs exactly once; serves "
        "history, alerts, Prometheus metrics and the RAA lambdas.",
    )
    app.state.settings = settings
    app.state.store = store
    app.state.rules = rules
    app.state.registry = registry
    app.state.service_metrics = service_metrics
    app.state.notifier = notifier
    app.state.background = background
    app.state.rate_limiter = RateLimiter(store, settings.rate_limit_per_s, settings.rate_limit_burst)
    for module in (runs, reports, queries, lambdas, alerts, ui):
        app.include_router(module.router)
    _add_service_routes(app)
    _add_error_handlers(app)
    app.add_middleware(TimingMiddleware, metrics=service_metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(InternalErrorMiddleware)
    return app


def app_from_env() -> FastAPI:
    """Factory for uvicorn workers: settings from the environment (``QKWATCH_*``), no migration."""
    return create_app(Settings(auto_migrate=False))


def _add_service_routes(app: FastAPI) -> None:
    expected = head_revision()

    @app.get("/healthz", response_model=HealthPublic, tags=["service"], responses={503: {"model": HealthPublic}})
    def healthz() -> JSONResponse:
        """Liveness, database reachability, and the database schema at the revision this code expects; no token.

        503 when the database is unreachable or its schema is at another revision (or none: an
        empty database), ``database`` saying which.
        """
        try:
            revision = app.state.store.schema_revision()
        except Exception as exc:
            logger.warning("health check: database unreachable: %s", _one_line(exc))
            if isinstance(getattr(exc, "orig", None), DatabaseFileGone):
                return _degraded("file deleted or replaced; restart the collector")
            return _degraded("unreachable")
        if revision != expected:
            logger.warning("health check: database schema at revision %s, expected %s", revision, expected)
            return _degraded(f"schema at revision {revision or 'none'}, expected {expected}")
        return JSONResponse({"status": "ok", "database": "ok", "version": __version__})

    @app.get("/metrics", include_in_schema=False)
    def metrics(viewer: Annotated[Principal | None, Depends(metrics_viewer)]) -> Response:
        """Prometheus exposition: a read token's project (all for ``*``), or everything when public."""
        projects = None if viewer is None else viewer.projects()
        scrape = Scrape(app.state.registry, app.state.store, app.state.settings, projects)
        return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)


def _degraded(database: str) -> JSONResponse:
    return JSONResponse(
        {"status": "degraded", "database": database, "version": __version__},
        503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _add_error_handlers(app: FastAPI) -> None:
    def count(request: Request, status: int) -> None:
        if request.url.path.endswith("/reports") and status in REJECT_REASONS:
            app.state.service_metrics.rejected.labels(REJECT_REASONS[status]).inc()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count(request, exc.status_code)
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, 422)
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, 422)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        count(request, 404)
        return JSONResponse({"detail": str(exc)}, 404)

    @app.exception_handler(DataError)
    async def data_error(request: Request, exc: DataError) -> JSONResponse:
        # A value the schema allows but the database cannot hold (e.g. out of its range).
        count(request, 422)
        return JSONResponse({"detail": f"a value cannot be stored: {exc.orig}"}, 422)

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        # The database is away (or not the one this code expects): 503 and Retry-After, so clients
        # retry, and JSON like every other answer. The cause goes to the log, not to the caller.
        code = getattr(exc.orig, "sqlstate", None)
        if isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated or code in SCHEMA_ERRORS:
            logger.warning("%s %s: database unavailable: %s", request.method, request.url.path, _one_line(exc))
            detail = (
                "the database schema is not what this collector expects (migrate it: qkwatch db upgrade)"
                if code in SCHEMA_ERRORS
                else "the database is unavailable"
            )
            return JSONResponse({"detail": f"{detail}; retry later"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        raise exc

    @app.exception_handler(Invalid)
    async def invalid(request: Request, exc: Invalid) -> JSONResponse:
        count(request, 422)
        return JSONResponse({"detail": str(exc)}, 422)


class InternalErrorMiddleware:
    """An exception no handler took becomes a JSON 500 (logged with its traceback) on a connection that stays usable.

    Starlette's last-resort handler answers in plain text and re-raises, and uvicorn then closes the
    connection without ``Connection: close``, so a client's next request on it fails. An exception
    after the response started still propagates: only closing the connection can tell the client.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if started:
                raise
            await JSONResponse({"detail": "internal server error"}, 500)(scope, receive, send)


class TimingMiddleware:
    """Observes each request's duration by route template (bounded), never the raw path (run ids)."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]  # an exception before the response started is a 500 to the client

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.duration.labels(scope["method"], route).observe(time.perf_counter() - start)
            if status[0] >= 500:
                self.metrics.server_errors.labels(scope["method"], route).inc()
