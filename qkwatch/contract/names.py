"""The metric names both sides use: what the agent reports, what the collector exports it as.

A report carries per-layer metrics (``layers``) and run scalars (``scalars``); their names follow
:data:`qkwatch.contract.values.METRIC_NAME_PATTERN`. The collector exports the ones named here to
Prometheus in base units (``_ratio`` for a fraction, ``_seconds``, ``_bytes``; ``_total`` only on
counters). The agent's own health series are reported once per rank: with several ranks each
name carries the suffix ``_rank<r>`` (:func:`rank_suffix`), which :func:`agent_rank` reads back.
"""

from __future__ import annotations

import re

# metric in the reports -> (exported name, help)
LAYER_GAUGES = {
    "qkai": ("qkwatch_qkai_ratio", "Query-key alignment index of the layer (mean over heads), latest report."),
    "stable_rank": ("qkwatch_stable_rank", "Stable rank of Wq Wk^T of the layer (mean over heads), latest report."),
    "attn_entropy": ("qkwatch_attn_entropy", "Normalised attention entropy of the layer, latest report."),
    "logit_max": (
        "qkwatch_attn_logit_max",
        "Largest scaled attention logit q.k/sqrt(d_head) of the layer's sampled rows, latest report.",
    ),
    "lambda": ("qkwatch_lambda", "RAA penalty weight the trainer applied to the layer, latest report."),
}
# run-level scalars the agent reports about itself (and the loss) -> (exported name, help)
SCALAR_GAUGES = {
    "loss": ("qkwatch_train_loss", "Training loss, latest report."),
    "agent_queue_depth": (
        "qkwatch_agent_queue_depth",
        "Reports the agent spooled that the collector has not acknowledged yet.",
    ),
    "agent_spool_bytes": ("qkwatch_agent_spool_bytes", "Bytes the agent spooled to disk, undelivered."),
    "agent_step_overhead_seconds": (
        "qkwatch_agent_step_overhead_seconds",
        "Seconds the agent added to the training step.",
    ),
}
SCALAR_COUNTERS = {
    "agent_sent_total": ("qkwatch_agent_sent", "Reports the agent delivered."),
    "agent_retried_total": ("qkwatch_agent_retried", "Deliveries the agent retried."),
    "agent_dropped_total": ("qkwatch_agent_dropped", "Reports the agent could not keep."),
    "agent_dead_lettered_total": (
        "qkwatch_agent_dead_lettered",
        "Reports the collector refused for good (kept in the agent's dead-letter.jsonl).",
    ),
}


AGENT_SCALARS = [name for name in [*SCALAR_GAUGES, *SCALAR_COUNTERS] if name.startswith("agent_")]
"""The agent's own health series: one per rank. With several ranks each agent reports its own,
suffixed ``_rank<r>`` (``agent_dropped_total_rank3``); they are exported under one name with a
``rank`` label (``"0"`` for a single-process run's unsuffixed series), for ranks below
``metrics_max_ranks``."""
_RANKED = re.compile(r"^(agent_\w+?)_rank(0|[1-9][0-9]{0,8})$")
_MALFORMED_RANK = -1


def rank_suffix(rank: int, world: int) -> str:
    """What a rank appends to its own series' names: ``_rank<r>`` with several ranks, nothing with one."""
    return f"_rank{rank}" if world > 1 else ""


def agent_rank(metric: str) -> tuple[str, int]:
    """``("agent_dropped_total", 3)`` for ``agent_dropped_total_rank3``; ``(metric, 0)`` for a name
    without a rank suffix. A suffix that is not a rank as the agent writes it (``_rank007``,
    ``_rankx``, ten digits or more) gives rank -1: such a series is never exported."""
    ranked = _RANKED.match(metric)
    if ranked:
        return ranked.group(1), int(ranked.group(2))
    base, sep, _ = metric.rpartition("_rank")
    return (base, _MALFORMED_RANK) if sep and base in AGENT_SCALARS else (metric, 0)
