"""Dependencies of the routes: the store, the settings, and the authenticated principal.

Auth: ``Authorization: Bearer <token>``. 401 without a token or with an unknown or revoked one;
403 when the token lacks the scope or belongs to another project; 429 (with Retry-After) over
the per-token rate. A token of project ``*`` may act on every project (an operator's token).
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from monitor.settings import Settings
from monitor.store.models import RunRow
from monitor.store.store import NotFound, Store, hash_token

SCOPES = ("ingest", "read", "control")
ALL_PROJECTS = "*"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token (id, name, project, scopes), or the open-mode anonymous user."""

    id: str
    name: str
    project: str
    scopes: frozenset[str]

    def sees_all(self) -> bool:
        return self.project == ALL_PROJECTS

    def projects(self) -> list[str] | None:
        """Projects visible to this principal, None = all."""
        return None if self.sees_all() else [self.project]

    def check_project(self, project: str) -> None:
        if not self.sees_all() and project != self.project:
            raise HTTPException(403, f"token {self.name!r} belongs to project {self.project!r}, not {project!r}")


OPEN_PRINCIPAL = Principal(id="open", name="open-access", project=ALL_PROJECTS, scopes=frozenset(SCOPES))


class RateLimiter:
    """Token buckets per token id: ``burst`` requests at once, ``rate`` per second sustained."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str, now: float | None = None) -> float:
        """Take one request; returns 0 when allowed, else the seconds to wait."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate


# The dependencies are ``async def`` on purpose: FastAPI runs a sync dependency in the thread
# pool, and each such hop costs more than these functions do (GET /lambdas must answer in ms).
async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def authenticate(request: Request) -> Principal:
    """The caller, from the bearer token (or the open-mode principal)."""
    settings: Settings = request.app.state.settings
    if settings.open_access:
        return OPEN_PRINCIPAL
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    digest = hash_token(token.strip())
    row = await run_in_threadpool(request.app.state.store.token_by_hash, digest)
    # The lookup is by the digest of a 32-byte random secret, so its timing says nothing useful;
    # the explicit constant-time comparison is the contract all the same.
    if row is None or not hmac.compare_digest(row.hash, digest) or row.revoked_at is not None:
        raise HTTPException(401, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"})
    wait = request.app.state.rate_limiter.acquire(row.id)
    if wait > 0:
        raise HTTPException(429, f"rate limit of {settings.rate_limit_per_s:g} requests/s exceeded for this token",
                            headers={"Retry-After": str(max(1, math.ceil(wait)))})
    return Principal(id=row.id, name=row.name, project=row.project, scopes=row.scopes)


def require(scope: str):
    """Dependency: an authenticated principal holding ``scope``."""

    async def dependency(principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if scope not in principal.scopes:
            raise HTTPException(403, f"token {principal.name!r} lacks the {scope!r} scope")
        return principal

    return dependency


Ingester = Annotated[Principal, Depends(require("ingest"))]
Reader = Annotated[Principal, Depends(require("read"))]
Controller = Annotated[Principal, Depends(require("control"))]


def load_run(store: Store, run_id: str, principal: Principal) -> RunRow:
    """The run, checked against the caller's project: 404 unknown, 403 another project's."""
    try:
        run = store.get_run(run_id)
    except NotFound:
        raise HTTPException(404, f"run {run_id} not found") from None
    principal.check_project(run.project)
    return run
