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

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from monitor.alerting.notifier import Notifier
from monitor.alerting.rules import RuleSet, with_webhooks
from monitor.api import alerts, lambdas, queries, reports, runs
from monitor.api.deps import RateLimiter
from monitor.api.limits import BodyLimitMiddleware
from monitor.api.schemas import HealthPublic
from monitor.exposition import REJECT_REASONS, ServiceMetrics, build_registry
from monitor.maintenance import Maintenance
from monitor.settings import Settings
from monitor.store.engine import make_engine
from monitor.store.migrate import upgrade
from monitor.store.store import Invalid, NotFound, Store
from monitor.ui import routes as ui

logger = logging.getLogger(__name__)

DOCS_ASSETS = "/ui/docs-assets"

try:
    from qkwatch import __version__
except ImportError:  # pragma: no cover - monitor installed without the CLI package
    __version__ = "0"


def load_rules(settings: Settings) -> RuleSet:
    rules = RuleSet.from_file(settings.alert_rules_file) if settings.alert_rules_file else RuleSet.default()
    return with_webhooks(rules, settings.webhook_urls)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the database is migrated here when ``settings.auto_migrate``."""
    settings = settings or Settings()
    store = Store(make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms))
    if settings.auto_migrate:
        upgrade(store.engine)
    rules = load_rules(settings)
    registry, service_metrics = build_registry(store, settings)
    notifier = Notifier(store, rules.webhooks, max_attempts=settings.webhook_max_attempts,
                        timeout_s=settings.webhook_timeout_s, external_url=settings.external_url)
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
    app = FastAPIOffline(title="qkwatch collector", version=__version__, lifespan=lifespan, static_url=DOCS_ASSETS,
                         description="Stores per-layer query-key diagnostics of training runs exactly once; serves "
                                     "history, alerts, Prometheus metrics and the RAA lambdas.")
    app.state.settings = settings
    app.state.store = store
    app.state.rules = rules
    app.state.registry = registry
    app.state.service_metrics = service_metrics
    app.state.notifier = notifier
    app.state.background = background
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
    for module in (runs, reports, queries, lambdas, alerts, ui):
        app.include_router(module.router)
    _add_service_routes(app)
    _add_error_handlers(app)
    app.add_middleware(TimingMiddleware, metrics=service_metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app


def app_from_env() -> FastAPI:
    """Factory for uvicorn workers: settings from the environment (``QKWATCH_*``), no migration."""
    return create_app(Settings(auto_migrate=False))


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/healthz", response_model=HealthPublic, tags=["service"])
    def healthz() -> JSONResponse:
        """Liveness and database reachability; needs no token."""
        try:
            app.state.store.ping()
        except Exception as exc:
            logger.warning("health check: database unreachable: %s", exc)
            return JSONResponse({"status": "degraded", "database": "unreachable", "version": __version__}, 503)
        return JSONResponse({"status": "ok", "database": "ok", "version": __version__})

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        """Prometheus exposition (no token: scrape over a trusted network)."""
        return Response(generate_latest(app.state.registry), media_type=CONTENT_TYPE_LATEST)


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
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                  for e in exc.errors()]
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

    @app.exception_handler(Invalid)
    async def invalid(request: Request, exc: Invalid) -> JSONResponse:
        count(request, 422)
        return JSONResponse({"detail": str(exc)}, 422)


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
