"""Pure parts of the API layer: strict JSON parsing, the rate limiter."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from monitor.api.deps import RateLimiter
from monitor.api.strict_json import parse_strict


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


def test_rate_limiter_refills_at_the_rate():
    limiter = RateLimiter(rate=2.0, burst=2)
    assert [limiter.acquire("t", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert limiter.acquire("t", now=0.5) == 0.0
    assert limiter.acquire("other", now=0.5) == 0.0
