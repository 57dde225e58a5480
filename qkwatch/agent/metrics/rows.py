"""The activation metrics' names, and those of your own: a function of each sampled row's attention probabilities.

A metric registered with :func:`activation_metric` (and given one entry in the catalogue,
``qkwatch.contract.metrics``) is measured wherever :func:`qkwatch.agent.metrics.attention_stats`
measures the built-in statistics: on the same sampled query rows of the same forward, with the
model's own scale, soft-cap, bias and mask. Every report then carries it per layer (the mean over
heads and sequences), and the collector, its exposition, the live page, the report and the Grafana
board follow the catalogue::

    @activation_metric("sink_mass")
    def sink_mass(p, rows):
        # the attention each row gives the first token, averaged over the rows that see a key
        return (p[..., 0] * rows).sum(-1) / rows.sum(-1)

The built-in names (``STAT_NAMES``, ``SPECTRUM_NAMES``, ``pr_q``, ``pr_k``, ``pr_gap``) and the weight
metrics' cannot be taken.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from qkwatch.agent.metrics.summary import HEAD_METRICS
from qkwatch.agent.metrics.summary import REGISTERED as WEIGHT_METRICS

RowMetric = Callable[[Tensor, Tensor], Tensor]
"""``(p, rows) -> (...)``: a value per head. ``p (..., T_q, T_k)``: each sampled row's attention
probabilities over the keys (0 on a key the row may not see); ``rows (T_q,)`` or ``(..., T_q)``: 1
for a row that sees a key, 0 for a padding token's row (leave those out)."""

REGISTERED: dict[str, RowMetric] = {}
"""The activation metrics added with :func:`activation_metric`, by name."""

STAT_NAMES = (
    "attn_entropy",
    "attn_entropy_nats",
    "attn_top1",
    "attn_top5",
    "attn_gap",
    "logit_mean",
    "logit_std",
    "logit_max",
    "qk_erank",
)
"""The built-in statistics of :func:`qkwatch.agent.metrics.attention_stats`, in its answer's order."""
SPECTRUM_NAMES = ("attn_srank", "attn_gap1")
"""Seed 003's quantities of :func:`qkwatch.agent.metrics.attention_spectrum`."""
PARTICIPATION = ("pr_q", "pr_k", "pr_gap")
"""The participation ratios' names (measured by the probe, beside ``attention_stats``)."""


def activation_metric(name: str) -> Callable[[RowMetric], RowMetric]:
    """Register a per-head metric of the sampled rows' attention under ``name``; reported from the next report on."""

    def register(fn: RowMetric) -> RowMetric:
        taken = (*STAT_NAMES, *SPECTRUM_NAMES, *PARTICIPATION, *HEAD_METRICS, *WEIGHT_METRICS, *REGISTERED)
        if name in taken:
            raise ValueError(f"a metric named {name!r} exists already")
        REGISTERED[name] = fn
        return fn

    return register


def row_metrics(p: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """Every registered activation metric of ``p`` (see :data:`RowMetric`)."""
    return {name: fn(p, rows) for name, fn in REGISTERED.items()}
