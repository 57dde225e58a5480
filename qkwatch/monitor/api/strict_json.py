"""Strict JSON request bodies, read only once the caller is known: a bare ``NaN``/``Infinity``
token is refused, naming the field.

Python's json module accepts those tokens, which are not JSON; a value that is not a number
must travel as the string "nan", "inf" or "-inf". The route class below swaps in a request
whose ``json()`` marks each bare constant, then reports the first one's path as a 422 in the
same shape as FastAPI's validation errors.

Before any of the body is read, the route checks the caller as its dependencies will
(:func:`qkwatch.monitor.api.deps.body_guard`): a request without a valid token, or without the
scope, is answered 401 or 403 with its body unread and unparsed. A body over
:data:`INLINE_PARSE_BYTES` is parsed in a worker thread, in a way that lets the event loop run
meanwhile (see :func:`_object`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from qkwatch.monitor.api.deps import body_guard

INLINE_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in a thread."""


class _Bare:
    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token


def _find(value: Any, path: tuple[str | int, ...], hit: Callable[[Any], bool]) -> tuple[Any, ...] | None:
    """``(*path, key, ..., value)`` of the first value (depth first) for which ``hit`` holds; None: none does."""
    if hit(value):
        return (*path, value)
    items: Iterable[tuple[str | int, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _find(item, (*path, key), hit)
        if found:
            return found
    return None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, built by a Python function rather than inside json's C scanner.

    The scanner holds the GIL for the whole body (a 4 MB body is tens of milliseconds), so a plain
    ``json.loads`` in a worker thread stalls the event loop as much as one on it. The interpreter
    hands the GIL on only while it runs Python code: this one call per object is where a parsing
    thread lets the event loop in (every ``sys.getswitchinterval()``, 5 ms), for a somewhat slower
    parse (``bench/auth_flood.py``).
    """
    return dict(pairs)


def parse_strict(body: bytes, in_thread: bool = False) -> Any:
    """``json.loads`` that raises a 422 HTTPException naming the field of a bare NaN/Infinity.

    A body nested deeper than the parser (or the search for the field) can go is a 422 too; the
    fields' own bounds (``contract.wire.MAX_JSON_DEPTH``) are far below that. ``in_thread``: the
    caller is a worker thread, which should let the event loop run while it parses (:func:`_object`).
    """
    try:
        return _parse(body, _object if in_thread else None)
    except RecursionError:
        raise HTTPException(
            422, detail=[{"type": "json_too_deep", "loc": ["body"], "msg": "the JSON body is nested too deeply"}]
        ) from None


def _parse(body: bytes, object_pairs_hook: Callable[[list[tuple[str, Any]]], dict[str, Any]] | None) -> Any:
    seen = []

    def constant(token: str) -> _Bare:
        seen.append(token)
        return _Bare(token)

    data = json.loads(body, parse_constant=constant, object_pairs_hook=object_pairs_hook)
    if b"\\u0000" in body:  # legal JSON, but no database stores NUL in text; refuse it up front
        found = _find(data, ("body",), lambda v: isinstance(v, str) and "\x00" in v) or _find(
            data, ("body",), lambda v: isinstance(v, dict) and any("\x00" in k for k in v)
        )
        if found:
            raise HTTPException(
                422,
                detail=[
                    {
                        "type": "nul_character",
                        "loc": list(found[:-1]),
                        "msg": "strings may not contain the NUL character (\\u0000)",
                    }
                ],
            )
    if seen:
        found = _find(data, ("body",), lambda v: isinstance(v, _Bare))
        assert found is not None  # each constant parse_constant saw is a _Bare somewhere in data
        *path, bare = found
        spelled = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[bare.token]
        raise HTTPException(
            422,
            detail=[
                {
                    "type": "bare_non_finite",
                    "loc": path,
                    "msg": f"bare {bare.token} is not JSON; send the string {spelled!r} instead",
                }
            ],
        )
    return data


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= INLINE_PARSE_BYTES:
                self._json = parse_strict(body)
            else:
                self._json = await run_in_threadpool(parse_strict, body, True)
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body is read only after the caller passed the route's auth, and parsed strictly."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        guard = body_guard(self.dependant) if self.body_field is not None else None

        async def strict_handler(request: Request) -> Response:
            if guard is not None:
                await guard(request)  # 401/403/429 with the body unread
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
