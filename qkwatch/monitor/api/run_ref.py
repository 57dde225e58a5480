"""A run named ``project/name`` in a path: ``/v1/runs/demo%2Fvanilla/series``.

An ASGI server decodes the path before routing, so an encoded slash would split the run's segment
in two and match no route. :class:`RunRefRoute` matches a request whose raw path holds ``%2F``
against that raw path instead, each segment decoded on its own, and hands the route the decoded
``project/name``; every other request is matched as usual. ``deps.load_run`` then resolves either
form. Run ids are 32 hex digits and names may not contain a slash, so the two never collide.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import unquote

from fastapi import Path
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Scope

from qkwatch.monitor.api.strict_json import StrictJSONRoute

RunRef = Annotated[str, Path(description="The run: its id, or `project/name` with the slash encoded as `%2F`")]


class RunRefRoute(APIRoute):
    """An APIRoute whose path parameters may hold an encoded slash (``%2F``)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        raw = scope.get("raw_path")
        if scope["type"] != "http" or not raw or b"%2f" not in raw.lower():
            return super().matches(scope)
        match, child = super().matches({**scope, "path": _keep_encoded_slashes(raw)})
        if match is not Match.NONE:
            child["path_params"] = {k: unquote(v) if isinstance(v, str) else v for k, v in child["path_params"].items()}
        return match, child


class StrictRunRefRoute(RunRefRoute, StrictJSONRoute):
    """Both: encoded slashes in the path and strictly parsed JSON bodies."""


def _keep_encoded_slashes(raw: bytes) -> str:
    """The raw path decoded segment by segment, each segment's own ``/`` and ``%`` re-encoded."""
    path = raw.split(b"?", 1)[0].decode("latin-1")
    return "/".join(unquote(seg).replace("%", "%25").replace("/", "%2F") for seg in path.split("/"))
