"""The fleet's settings: one session's :class:`FleetConfig`, the servers it uses, and the metric names
and collapsing layers of the synthetic reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = os.environ.get("QKWATCH_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
HAPROXY = "/usr/sbin/haproxy"
PROJECT = "fleet"

WEIGHT_METRICS = ("qkai", "qkai_max", "stable_rank", "qk_cos")
"""Per-layer weight metrics of every report (``qkwatch/agent/metrics/summary.py: weight_metrics``)."""
SPECTRA_METRICS = ("wq_fro", "wk_fro", "wq_spec", "wk_spec", "wk_erank")
"""Projection spectra, on every ``spectra_every``-th report."""
ACTIVATION_METRICS = (
    "attn_entropy",
    "attn_entropy_nats",
    "attn_top1",
    "attn_top5",
    "attn_gap",
    "attn_gap1",
    "attn_srank",
    "logit_mean",
    "logit_std",
    "logit_max",
    "qk_erank",
    "pr_q",
    "pr_k",
    "pr_gap",
)
"""Per-layer activation metrics of every report (``qkwatch/agent/probe/probe.py``), as a real report carries them."""
HOT_LAYERS = (20, 21, 22, 23, 24, 25, 40)
"""Layers whose QKAI rises through the threshold in a collapsing run (20-25 are a band, 40 alone)."""
BAND = (20, 21, 22, 23, 24, 25)
THRESHOLD = 0.70


@dataclass
class FleetConfig:
    """One fleet session."""

    replicas: int = 2
    """``qkwatch serve`` processes behind the balancer."""
    workers: int = 2
    """``--workers`` of each replica."""
    ranks: int = 64
    """Simulated agent ranks in all."""
    ranks_per_run: int = 4
    """Ranks of one run (its world size); ranks / ranks_per_run runs."""
    layers: int = 48
    duration: float = 300.0
    """Seconds of load."""
    step_seconds: float = 0.1
    """A simulated training step every this many seconds (rank 0 logs a loss at each)."""
    report_every: int = 5
    """A full report every this many steps."""
    spectra_every: int = 10
    """The projection spectra ride on every this-many-th report."""
    lambda_poll_seconds: float = 1.0
    """Rank 0's lambda poll period (the agent's default is 5 s, compressed here like the steps)."""
    kill_at: float | None = 0.5
    """When to SIGKILL the last replica, as a fraction of ``duration``; None: never."""
    down_seconds: float = 5.0
    """How long the killed replica stays down before it is restarted."""
    drain_seconds: float | None = None
    """After the load, how long the agents may take to deliver what their spools still hold (None:
    3 x ``duration`` + 60 s, room for a collector that took a third of what was offered)."""
    agent_procs: int = 2
    """Processes the ranks are spread over (their sender threads share one GIL per process)."""
    sample_seconds: float = 1.0
    """How often the sampler reads one run's lambdas from every replica directly."""
    pg_admin_url: str = PG_ADMIN_URL
    haproxy: str = HAPROXY

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"replicas: a fleet needs at least 2, got {self.replicas}")
        if self.ranks < self.ranks_per_run or self.ranks % self.ranks_per_run:
            raise ValueError(f"ranks: {self.ranks} is not a multiple of ranks_per_run={self.ranks_per_run}")
        if self.layers <= max(HOT_LAYERS):
            raise ValueError(f"layers: at least {max(HOT_LAYERS) + 1} (the collapsing layers), got {self.layers}")

    @property
    def drain(self) -> float:
        return self.drain_seconds if self.drain_seconds is not None else 3 * self.duration + 60

    @property
    def runs(self) -> int:
        return self.ranks // self.ranks_per_run

    @property
    def steps(self) -> int:
        return max(1, round(self.duration / self.step_seconds))
