"""The agent-overhead bench's statistics: each round's overhead (the slowest rank's), the mean, median and
95 % percentile-bootstrap interval, and the extra time by position in the round.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

RESAMPLES = 10_000


def bootstrap_mean(values: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of ``values``."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(per_rank: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Rounds' overheads (a round's time: the slowest rank's), their statistics and a per-position breakdown."""
    rounds = len(per_rank[0]["times"])
    a_sum = np.array([max(sum(r["times"][i]["A"]) for r in per_rank) for i in range(rounds)])
    b_sum = np.array([max(sum(r["times"][i]["B"]) for r in per_rank) for i in range(rounds)])
    rel = a_sum / b_sum - 1.0
    low, high = bootstrap_mean(rel)
    # the training thread's time inside the agent, as a share of the round without it (slowest rank)
    inside = np.array([max(r["times"][i]["agent"][0] for r in per_rank) for i in range(rounds)])
    share = inside / b_sum
    share_low, share_high = bootstrap_mean(share)
    worker = np.array([max(r["times"][i]["worker"][0] for r in per_rank) for i in range(rounds)])
    first = per_rank[0]["times"]  # rank 0's steps by position in the round
    sinks = sinks_summary(first, b_sum) if "sinks" in first[0] else {}

    def extra(pos: Callable[[int], bool]) -> float:
        """Median over rounds of A - B summed over the positions selected (ms)."""
        per_round = [sum(a - b for j, (a, b) in enumerate(zip(t["A"], t["B"], strict=True)) if pos(j)) for t in first]
        return 1e3 * statistics.median(per_round)

    return {
        "rounds": rounds,
        "a_step": float(a_sum.mean()) / every,
        "b_step": float(b_sum.mean()) / every,
        "mean": float(rel.mean()),
        "median": float(np.median(rel)),
        "low": low,
        "high": high,
        "rel": rel,
        "report_pair": extra(lambda j: j in (0, 1)),
        "report_step": extra(lambda j: j == 0),
        "next_step": extra(lambda j: j == 1),
        "plain_steps": extra(lambda j: j not in (0, 1)) / (every - 2),
        "close": max(r["close"] for r in per_rank),
        "params": per_rank[0]["params"],
        "inside_ms": 1e3 * float(inside.mean()),
        "worker_ms": 1e3 * float(worker.mean()),
        "share": float(share.mean()),
        "share_low": share_low,
        "share_high": share_high,
        **sinks,
    }


def sinks_summary(times: list[dict[str, list[float]]], b_sum: np.ndarray) -> dict[str, Any]:
    """``--sinks`` (one rank): arm B's training thread inside its agent, arm A's minus arm B's as a share
    of the round without the sinks (with its bootstrap interval), and the sinks' worker per round."""
    inside_a = np.array([t["agent"][0] for t in times])
    inside_b = np.array([t["agent_b"][0] for t in times])
    extra = (inside_a - inside_b) / b_sum
    low, high = bootstrap_mean(extra)
    return {
        "inside_b_ms": 1e3 * float(inside_b.mean()),
        "share_b": float((inside_b / b_sum).mean()),
        "inside_extra": float(extra.mean()),
        "inside_extra_low": low,
        "inside_extra_high": high,
        "sinks_wall_ms": 1e3 * float(np.mean([t["sinks"][0] for t in times])),
        "sinks_cpu_ms": 1e3 * float(np.mean([t["sinks"][1] for t in times])),
    }
