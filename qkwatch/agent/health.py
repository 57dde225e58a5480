"""The agent's own health: counters the sender and the writer keep, and the scalars they travel as.

Every report carries them (``agent_queue_depth``, ``agent_spool_bytes``, ``agent_sent_total``,
``agent_retried_total``, ``agent_dead_lettered_total``, ``agent_step_overhead_seconds``,
``agent_dropped_total``), suffixed ``_rank<r>`` when there is more than one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Health:
    """The agent's own counters; they travel with every report."""

    sent: int = 0
    retried: int = 0
    dead_lettered: int = 0
    written: int = 0
    acked: int = 0
    last_error: str = ""

    @property
    def queue_depth(self) -> int:
        return max(0, self.written - self.acked)


@dataclass
class Overhead:
    """Seconds the agent's calls took on the training thread since the last report, and the steps."""

    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float, *, step: bool = False) -> None:
        self.seconds += seconds
        self.steps += step

    def take_mean(self) -> float:
        """Seconds per step since the last call; starts over."""
        mean = self.seconds / max(1, self.steps)
        self.seconds, self.steps = 0.0, 0
        return mean


def health_scalars(health: Health, *, spool_bytes: int, overhead: float, suffix: str) -> dict[str, float]:
    """The counters as report scalars (``suffix``: ``_rank<r>``, or empty with one rank)."""
    values = {
        "agent_queue_depth": health.queue_depth,
        "agent_spool_bytes": spool_bytes,
        "agent_sent_total": health.sent,
        "agent_retried_total": health.retried,
        "agent_dead_lettered_total": health.dead_lettered,
        "agent_step_overhead_seconds": overhead,
    }
    return {f"{k}{suffix}": float(v) for k, v in values.items()}


class DropNotes:
    """Puts the running count of dropped reports on each report, and an event when it has grown."""

    def __init__(self, already: int, suffix: str):
        self.reported = already
        """The count the last event (or the spool, at start) told of."""
        self.suffix = suffix

    def note(self, report: dict[str, Any], dropped: int) -> None:
        """Add ``agent_dropped_total`` (and, if it grew, a ``dropped`` event) to an encoded report."""
        report["scalars"][f"agent_dropped_total{self.suffix}"] = float(dropped)
        if dropped <= self.reported:
            return
        count, self.reported = dropped - self.reported, dropped
        report.setdefault("events", []).append(
            {
                "kind": f"dropped{self.suffix}",
                "message": f"{count} report(s) dropped: the spool's caps, a full host-copy queue, or a disk "
                "that refused them past the memory bound",
                "data": {"count": count},
            }
        )
