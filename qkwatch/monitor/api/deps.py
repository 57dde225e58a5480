"""Dependencies of the routes: the store, the settings, and the authenticated principal.

Auth: ``Authorization: Bearer <token>``. 401 without a token or with an unknown or revoked one;
403 when the token lacks the scope or belongs to another project (the answer names neither that
project nor anything of it); 429 (with Retry-After) over the per-token rate, which every worker and
replica on the database shares. A token of project ``*`` may act on every project (an operator's token).

A route with a request body decides all of that before the body is read (:func:`body_guard`), so an
unauthenticated or unauthorised caller costs no parsing, however large its body.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.dependencies.models import Dependant
from starlette.concurrency import run_in_threadpool

from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.models import RunRow
from qkwatch.monitor.store.store import NotFound, Store, hash_token
from qkwatch.monitor.store.tokens import TokenRow
from qkwatch.monitor.store.transactions import Snapshot

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
        """403 unless the principal may act on ``project``; the answer does not name ``project``."""
        if not self.sees_all() and project != self.project:
            raise HTTPException(403, f"token {self.name!r} may act only on project {self.project!r}")


OPEN_PRINCIPAL = Principal(id="open", name="open-access", project=ALL_PROJECTS, scopes=frozenset(SCOPES))


class RateLimiter:
    """Per-token rate limit: ``burst`` requests at once, ``rate`` per second sustained, across processes.

    The token bucket of each key is a row in the database (:meth:`Store.take_tokens`), so the
    limit holds however many workers and replicas serve the token. To keep a database write off
    most requests, a process takes a small lease of tokens at a time (about 50 ms of the rate) and
    spends it locally for at most ``lease_s``; unspent tokens expire unused. A lease is taken from
    the shared bucket, so the limit errs only on the strict side, and each process is at most
    one lease ahead of the bucket.
    """

    def __init__(self, store: Store, rate: float, burst: int, lease_s: float = 1.0) -> None:
        self.store, self.rate, self.burst, self.lease_s = store, rate, burst, lease_s
        self.lease = max(1, min(burst, int(rate * 0.05)))
        self._leases: dict[str, tuple[int, float]] = {}  # key -> (tokens left, valid until)
        self._lock = threading.Lock()

    def acquire(self, key: str, now: float | None = None) -> float:
        """Take one request (a database call when this process's lease is spent): 0 when allowed,
        else the seconds to wait."""
        now = time.time() if now is None else now
        with self._lock:
            left, until = self._leases.get(key, (0, 0.0))
            if left > 0 and now < until:
                self._leases[key] = (left - 1, until)
                return 0.0
        taken, wait = self.store.take_tokens(key, self.lease, self.rate, self.burst, now)
        if not taken:
            return wait
        with self._lock:
            self._leases[key] = (taken - 1, now + self.lease_s)
        return 0.0


# The dependencies are ``async def`` on purpose: FastAPI runs a sync dependency in the thread
# pool, and each such hop costs more than these functions do (GET /lambdas must answer in ms).
async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def authenticate(request: Request) -> Principal:
    """The caller, from the bearer token (or the open-mode principal); looked up once per request, so
    a route's early check (:func:`body_guard`) and its dependencies share one lookup and one rate token."""
    known: Principal | None = getattr(request.state, "principal", None)
    if known is None:
        known = request.state.principal = await _identify(request)
    return known


async def _identify(request: Request) -> Principal:
    settings: Settings = request.app.state.settings
    if settings.open_access:
        return OPEN_PRINCIPAL
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPException(
            401, "missing bearer token: send 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
        )
    digest = hash_token(token.strip())
    row, wait = await run_in_threadpool(
        _token_and_rate, request.app.state.store, request.app.state.rate_limiter, digest
    )
    if row is None:
        raise HTTPException(401, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"})
    if wait > 0:
        raise HTTPException(
            429,
            f"rate limit of {settings.rate_limit_per_s:g} requests/s exceeded for this token",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
    return Principal(id=row.id, name=row.name, project=row.project, scopes=row.scopes)


def _token_and_rate(store: Store, limiter: RateLimiter, digest: str) -> tuple[TokenRow | None, float]:
    """The valid token of ``digest`` (None: unknown or revoked) and its rate-limit wait, in one thread hop."""
    row = store.token_by_hash(digest)
    # The lookup is by the digest of a 32-byte random secret, so its timing says nothing useful;
    # the explicit constant-time comparison is the contract all the same.
    if row is None or not hmac.compare_digest(row.hash, digest) or row.revoked_at is not None:
        return None, 0.0
    return row, limiter.acquire(row.id)


async def metrics_viewer(request: Request) -> Principal | None:
    """Who may scrape /metrics: a token with the read scope, or anyone (None) when the operator
    made /metrics public (``metrics_public``) or runs without authentication."""
    settings: Settings = request.app.state.settings
    if settings.metrics_public or settings.open_access:
        return None
    return await require("read")(await authenticate(request))


@dataclass(frozen=True)
class Scoped:
    """Dependency: the authenticated principal, which must hold one of ``scopes``."""

    scopes: tuple[str, ...]

    async def __call__(self, principal: Annotated[Principal, Depends(authenticate)]) -> Principal:
        self.check(principal)
        return principal

    def check(self, principal: Principal) -> None:
        """403 naming the scope (or scopes) unless ``principal`` holds one of them."""
        if not principal.scopes & set(self.scopes):
            wanted = " or ".join(map(repr, self.scopes))
            raise HTTPException(403, f"token {principal.name!r} lacks the {wanted} scope")


def require(*scopes: str) -> Scoped:
    """Dependency: an authenticated principal holding ``scopes[0]`` (or any other of ``scopes``)."""
    return Scoped(scopes)


def body_guard(dependant: Dependant) -> Callable[[Request], Awaitable[None]] | None:
    """What a route's dependencies will decide about the caller, as a check to run before its body is
    read (None: the route authenticates no one).

    FastAPI reads and parses a body before it solves the dependencies, so without this check a
    request with no token would cost the server its whole body's parsing before its 401.
    """
    calls = list(_calls(dependant))
    if authenticate not in calls and not any(isinstance(c, Scoped) for c in calls):
        return None
    checks = [c for c in calls if isinstance(c, Scoped)]

    async def guard(request: Request) -> None:
        principal = await authenticate(request)
        for check in checks:
            check.check(principal)

    return guard


def _calls(dependant: Dependant) -> Iterator[object]:
    """The callables of every dependency of ``dependant``, however deep."""
    for sub in dependant.dependencies:
        yield sub.call
        yield from _calls(sub)


Ingester = Annotated[Principal, Depends(require("ingest"))]
Reader = Annotated[Principal, Depends(require("read"))]
Controller = Annotated[Principal, Depends(require("control"))]


def load_run(store: Store | Snapshot, run_id: str, principal: Principal) -> RunRow:
    """The run named by its id or ``project/name``, checked against the caller's project: 404 unknown,
    403 another project's (for ``project/name``, before the lookup: no one learns which names exist).

    ``store`` may be a :class:`Snapshot`, so that the run and what the route reads next come from one
    transaction."""
    try:
        if "/" in run_id:
            project, name = run_id.split("/", 1)
            principal.check_project(project)
            return store.get_run_by_name(project, name)
        run = store.get_run(run_id)
    except NotFound:
        raise HTTPException(404, f"run {run_id} not found") from None
    principal.check_project(run.project)
    return run
