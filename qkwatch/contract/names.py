"""The rank suffix of the agent's own health series.

A report carries per-layer metrics (``layers``) and run scalars (``scalars``); their names follow
:data:`qkwatch.contract.values.METRIC_NAME_PATTERN`, and what each is and what the collector exports
it as is in the catalogue (:mod:`qkwatch.contract.metrics`). The agent's own health series are
reported once per rank: with several ranks each name carries the suffix ``_rank<r>``
(:func:`rank_suffix`), which :func:`agent_rank` reads back.
"""

from __future__ import annotations

import re

from qkwatch.contract.metrics import CATALOGUE

AGENT_SCALARS = [m.name for m in CATALOGUE.values() if m.per_rank]
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
