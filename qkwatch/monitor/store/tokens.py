"""Bearer tokens (only their sha256 is stored) and the per-token rate-limit buckets."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from qkwatch.monitor.store import models as m
from qkwatch.monitor.store import sql
from qkwatch.monitor.store.engine import is_postgres


@dataclass(frozen=True)
class TokenRow:
    id: str
    project: str
    name: str
    scopes: frozenset[str]
    hash: str
    revoked_at: float | None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(
    conn: sa.Connection, project: str, scopes: Sequence[str], name: str | None, now: float
) -> tuple[TokenRow, str]:
    """Mint a token; returns its row and the secret, which is not stored (only its sha256)."""
    token_id = secrets.token_hex(6)
    secret = f"qkw_{token_id}_{secrets.token_urlsafe(32)}"
    row = TokenRow(
        id=token_id,
        project=project,
        name=name or token_id,
        scopes=frozenset(scopes),
        hash=hash_token(secret),
        revoked_at=None,
    )
    conn.execute(
        sa.insert(m.tokens).values(
            id=row.id,
            project=project,
            name=row.name,
            scopes=",".join(sorted(row.scopes)),
            hash=row.hash,
            created_at=now,
        )
    )
    return row, secret


def by_hash(conn: sa.Connection, digest: str) -> TokenRow | None:
    r = conn.execute(sa.select(m.tokens).where(m.tokens.c.hash == digest)).first()
    if r is None:
        return None
    return TokenRow(
        id=r.id,
        project=r.project,
        name=r.name,
        scopes=frozenset(filter(None, r.scopes.split(","))),
        hash=r.hash,
        revoked_at=r.revoked_at,
    )


def select_all(conn: sa.Connection) -> list[TokenRow]:
    rows = conn.execute(sa.select(m.tokens).order_by(m.tokens.c.created_at)).all()
    return [TokenRow(r.id, r.project, r.name, frozenset(r.scopes.split(",")), r.hash, r.revoked_at) for r in rows]


def revoke(conn: sa.Connection, token_id: str, now: float) -> bool:
    """Revoke the token; False when there is none of that id."""
    return bool(conn.execute(sa.update(m.tokens).where(m.tokens.c.id == token_id).values(revoked_at=now)).rowcount)


def take(conn: sa.Connection, key: str, want: int, rate: float, burst: int, now: float) -> tuple[int, float]:
    """Take up to ``want`` tokens from the bucket ``key`` (``burst`` at most, refilled at ``rate`` per second).

    The bucket is a row, so every worker and replica on the database draws from the same one.
    Returns (tokens taken, seconds until one is available): (0, wait) when none is.
    """
    b = m.rate_buckets
    if is_postgres(conn):  # a lost bucket update after a crash costs nothing worth an fsync
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
    conn.execute(sql.insert(conn, b).values(key=key, tokens=float(burst), updated_at=now).on_conflict_do_nothing())
    row = conn.execute(sa.select(b.c.tokens, b.c.updated_at).where(b.c.key == key).with_for_update()).one()
    # Clocks of replicas differ a little: time never runs backwards for a bucket.
    tokens = min(float(burst), row.tokens + max(0.0, now - row.updated_at) * rate)
    taken = min(want, int(tokens)) if tokens >= 1 else 0
    conn.execute(sa.update(b).where(b.c.key == key).values(tokens=tokens - taken, updated_at=max(now, row.updated_at)))
    return taken, 0.0 if taken else (1 - tokens) / rate
