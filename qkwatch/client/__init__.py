"""The collector seen from outside: the REST client, its typed results, and what is built on them.

``from qkwatch.client import Client`` (also ``qkwatch.Client``) is the REST client
(:mod:`qkwatch.client.rest`); ``qkwatch report`` builds its HTML from it (``report*``), and
``qkwatch alerts backtest`` replays a run's history through the alert rules (``backtest``,
``run_history``, ``outcomes``). Nothing here needs the collector's own libraries (fastapi,
SQLAlchemy): ``pip install qkwatch`` is enough. The names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkwatch.client.rest import Client, CollectorError

__all__ = ["Client", "CollectorError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("qkwatch.client.rest"), name)
    raise AttributeError(f"module 'qkwatch.client' has no attribute {name!r}")
