"""``qkwatch sync SPOOL_DIR``: deliver what an agent spooled while the collector was away.

Exactly once however often it runs: the spool's cursor moves only past what the collector has
stored, batch ids are derived from the records' place in the spool, and the collector ignores
points it already holds. Takes the spool's lock, so it refuses to run beside a live agent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from qkwatch.agent.health import Health
from qkwatch.agent.shipping.disk_spool import Spool, SpoolLocked
from qkwatch.agent.shipping.shipper import Sender
from qkwatch.agent.shipping.transport import HttpTransport

logger = logging.getLogger(__name__)


class SyncError(Exception):
    """Nothing to sync at that path, or its spool is in use."""


@dataclass
class SyncResult:
    spool: Path
    delivered: int
    left: int
    dead_lettered: int


def find_spools(root: str | Path) -> list[Path]:
    """Spool directories (holding ``meta.json``) at or below ``root``."""
    root = Path(root)
    if not root.exists():
        raise SyncError(f"no such directory: {root}")
    found = sorted({p.parent for p in root.rglob("meta.json")})
    if not found:
        raise SyncError(f"{root} holds no agent spool (no meta.json below it)")
    return found


def sync(
    root: str | Path,
    collector: str | None = None,
    token: str | None = None,
    *,
    timeout: float = 300.0,
    batch_max: int = 256,
) -> list[SyncResult]:
    """Deliver every spool below ``root`` to ``collector`` (default: the URL each spool recorded)."""
    results = []
    for path in find_spools(root):
        try:
            spool = Spool(path)
        except SpoolLocked as exc:
            raise SyncError(str(exc)) from None
        try:
            meta = spool.read_meta()
            if not all(isinstance(meta.get(key), str) and meta[key] for key in ("project", "name")):
                raise SyncError(f"{path / 'meta.json'} names no project or run: its reports cannot be delivered")
            url = collector or meta.get("url")
            if not url:
                raise SyncError(f"{path}: the spool records no collector URL; pass --collector")
            health = Health()
            sender = Sender(
                spool,
                partial(HttpTransport, url, token, 30.0),
                batch_max=batch_max,
                flush_seconds=0.1,
                backoff_base=0.5,
                backoff_cap=10.0,
                health=health,
            )
            sender.deliver_all(time.monotonic() + timeout)
            left = len(spool.pending(10**9))
            results.append(SyncResult(path, health.sent, left, health.dead_lettered))
        finally:
            spool.close()
    return results
