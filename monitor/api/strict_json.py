"""Strict JSON request bodies: a bare ``NaN``/``Infinity`` token is refused, naming the field.

Python's json module accepts those tokens, which are not JSON; a value that is not a number
must travel as the string "nan", "inf" or "-inf". The route class below swaps in a request
whose ``json()`` marks each bare constant, then reports the first one's path as a 422 in the
same shape as FastAPI's validation errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute


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


def parse_strict(body: bytes) -> Any:
    """``json.loads`` that raises a 422 HTTPException naming the field of a bare NaN/Infinity.

    A body nested deeper than the parser (or the search for the field) can go is a 422 too; the
    fields' own bounds (``monitor.wire.MAX_JSON_DEPTH``) are far below that.
    """
    try:
        return _parse(body)
    except RecursionError:
        raise HTTPException(
            422, detail=[{"type": "json_too_deep", "loc": ["body"], "msg": "the JSON body is nested too deeply"}]
        ) from None


def _parse(body: bytes) -> Any:
    seen = []

    def constant(token: str) -> _Bare:
        seen.append(token)
        return _Bare(token)

    data = json.loads(body, parse_constant=constant)
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
            self._json = parse_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON bodies are parsed strictly."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
