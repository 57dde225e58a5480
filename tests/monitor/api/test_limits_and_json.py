"""Parts of the API layer: strict JSON parsing (pure), the rate limiter (over a real SQLite database)."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from qkwatch.monitor.api.deps import RateLimiter
from qkwatch.monitor.api.strict_json import parse_strict
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store


def test_bare_constants_name_their_path():
    for text, loc in ((b'{"a": [1, Infinity]}', ["body", "a", 1]), (b'{"x": {"y": -Infinity}}', ["body", "x", "y"])):
        with pytest.raises(HTTPException) as err:
            parse_strict(text)
        assert err.value.status_code == 422 and err.value.detail[0]["loc"] == loc
    assert parse_strict(b'{"a": "nan"}') == {"a": "nan"}


def test_nul_characters_are_refused():
    with pytest.raises(HTTPException) as err:
        parse_strict(b'{"config": {"k": "a\\u0000b"}}')
    assert err.value.detail[0]["loc"] == ["body", "config", "k"]


def test_rate_limiter_refills_at_the_rate(sqlite_url: str):
    store = Store(make_engine(sqlite_url))  # the buckets are rows: shared by every process on the database
    try:
        limiter = RateLimiter(store, rate=2.0, burst=2)
        assert [limiter.acquire("t", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
        assert limiter.acquire("t", now=0.5) == 0.0
        assert limiter.acquire("other", now=0.5) == 0.0
    finally:
        store.close()


def test_rate_limiter_leases_tokens_to_spare_the_database(sqlite_url: str):
    store = Store(make_engine(sqlite_url))
    try:
        limiter = RateLimiter(store, rate=200.0, burst=400)  # a lease of 10 tokens
        assert limiter.lease == 10
        assert all(limiter.acquire("t", now=100.0) == 0.0 for _ in range(10))
        taken, _ = store.take_tokens("t", 1000, 200.0, 400, now=100.0)
        assert taken == 390  # one lease was taken from the shared bucket for ten requests
    finally:
        store.close()
