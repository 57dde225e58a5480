"""Which run and attempt an agent reports to: decided once at attach, kept in the spool's meta.json.

The run is named by project and name (the same pair resumes a run); an attempt by a key every rank
of one process group shares, so the collector counts one attempt per launch. Rank 0 decides both
and shares them in one collective. The spool's ``meta.json`` records the identity, so whoever
delivers the spool later (the next run, ``qkwatch sync``) creates or resumes the same run, and a
record carries the attempt key of the process that wrote it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from qkwatch.agent.shipping.disk_spool import Spool


@dataclass(frozen=True)
class RunIdentity:
    project: str
    name: str
    config: dict[str, Any]
    """The run's config as the collector stores it."""
    attempt_key: str | None
    """Shared by every rank of one launch; None for records spooled before attempts had keys."""
    tags: tuple[str, ...] = ()
    """Added to the run's tags when it is created or resumed."""
    notes: str | None = None
    """The run's notes when it has none yet."""

    @classmethod
    def agree(
        cls,
        project: str,
        name: str | None,
        config: dict[str, Any],
        group: Any = None,
        *,
        tags: tuple[str, ...] = (),
        notes: str | None = None,
    ) -> RunIdentity:
        """Rank 0's name (``name``, or a new ``run-<time>-<hex>``), tags and notes and a new attempt key,
        on every rank of ``group`` (a torch.distributed process group; None: this process alone)."""
        mine: list[Any] = [name or time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], uuid.uuid4().hex]
        mine += [tags, notes]
        if group is not None:
            import torch.distributed as dist  # here only: `qkwatch sync` reads identities without torch

            dist.broadcast_object_list(mine, src=0, group=group)
        return cls(project, mine[0], config, mine[1], tuple(mine[2]), mine[3])

    @classmethod
    def of_spool(cls, meta: dict[str, Any], attempt_key: str | None) -> RunIdentity:
        """The run a spool belongs to (its ``meta.json``), for a record of ``attempt_key``."""
        return cls(
            meta["project"],
            meta["name"],
            meta.get("config", {}),
            attempt_key or None,
            tuple(meta.get("tags", ())),
            meta.get("notes"),
        )

    def create_body(self) -> dict[str, Any]:
        """``POST /v1/runs``: create this run, or resume it as this attempt.

        ``tags`` and ``notes`` go only when there are some, so a run without them can still be
        delivered to a collector older than them.
        """
        body: dict[str, Any] = {
            "project": self.project,
            "name": self.name,
            "config": self.config,
            "attempt_key": self.attempt_key,
        }
        if self.tags:
            body["tags"] = list(self.tags)
        if self.notes:
            body["notes"] = self.notes
        return body

    def claim(self, spool: Spool, *, url: str | None, rank: int) -> None:
        """Record this identity, the collector URL and the rank in the spool's meta.json (keeping its id and run id)."""
        meta = spool.read_meta()
        spool.write_meta(
            {
                **meta,
                "spool_id": meta.get("spool_id", str(uuid.uuid4())),
                "url": url,
                "project": self.project,
                "name": self.name,
                "config": self.config,
                "attempt_key": self.attempt_key,
                "tags": list(self.tags),
                "notes": self.notes,
                "rank": rank,
            }
        )
