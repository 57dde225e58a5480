"""The metric catalogue: every metric qkwatch names, once, with what each part needs to know of it.

An entry says what the metric measures (one line), its unit and range, whether it is reported per
layer or per run, what Prometheus exports it as (if it does), how a page names and colours it, the
threshold it is read against, and whether it is shown first. The agent checks the names it reports
against it; the collector's exposition, the live page (``/ui/metrics.json``), ``qkwatch report`` and
the Grafana generator read it. Adding a metric is one entry here and the function that measures it
(docs/metrics.md, "Adding a metric").

The definitions themselves are docs/metrics.md's; the summaries here are for help texts and tooltips.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

Scope = Literal["layer", "run"]
Kind = Literal["gauge", "counter"]
Colour = Literal["threshold", "sequential", "diverging"]
"""``threshold``: the colour scale that breaks at the metric's threshold (``colour_scale``);
``sequential``: low to high on one ramp; ``diverging``: around zero."""
ThresholdName = Literal["collapse", "h_star"]
"""Which of ``qkwatch.contract.thresholds.Thresholds`` the metric is read against."""


@dataclass(frozen=True)
class Metric:
    """One metric: see the module's docstring."""

    name: str
    """The name in reports (``layers`` for a layer metric, ``scalars`` for a run one)."""
    summary: str
    """What it measures, in one line."""
    display: str
    """How a page or a dashboard names it."""
    scope: Scope = "layer"
    unit: str = ""
    """``ratio`` (a fraction in [0, 1]), ``nats``, ``seconds``, ``bytes``, ``count``, or empty (a pure number)."""
    low: float | None = None
    """The least value it can take (None: unbounded)."""
    high: float | None = None
    """The largest value it can take (None: unbounded, or bounded by the model's shape)."""
    prometheus: str | None = None
    """The name the collector exports it under (in base units), or None: not exported."""
    kind: Kind = "gauge"
    colour: Colour = "sequential"
    threshold: ThresholdName | None = None
    primary: bool = False
    """Shown first: the live page's default choices, the report's heatmaps, the Grafana run board."""
    per_rank: bool = False
    """The agent's own health series: one per rank (``_rank<r>`` with several ranks)."""

    def help(self) -> str:
        """The Prometheus help text: the summary, and for a value of the run's reports "latest report"."""
        return self.summary if self.per_rank else f"{self.summary.rstrip('.')}, latest report."


_layer = functools.partial(Metric, scope="layer")
_run = functools.partial(Metric, scope="run")


_ENTRIES = (
    # the collapse itself (seed 000), from the weights
    _layer(
        "qkai",
        "Query-key alignment index of the layer (mean over heads).",
        "QKAI",
        unit="ratio",
        low=0.0,
        high=1.0,
        prometheus="qkwatch_qkai_ratio",
        colour="threshold",
        threshold="collapse",
        primary=True,
    ),
    _layer(
        "qkai_max",
        "Query-key alignment index of the layer's most aligned head.",
        "QKAI, worst head",
        unit="ratio",
        low=0.0,
        high=1.0,
        colour="threshold",
        threshold="collapse",
    ),
    _layer(
        "stable_rank",
        "Stable rank of Wq Wk^T of the layer (mean over heads).",
        "Stable rank of Wq Wk^T",
        low=1.0,
        prometheus="qkwatch_stable_rank",
        primary=True,
    ),
    _layer(
        "qk_cos",
        "Mean |cos| between matching columns of Wq and Wk (seed 001).",
        "Wq/Wk column alignment",
        low=0.0,
        high=1.0,
    ),
    _layer("wq_fro", "Frobenius norm of the layer's query projection.", "||Wq||_F", low=0.0),
    _layer("wq_spec", "Spectral norm of the layer's query projection.", "||Wq||_2", low=0.0),
    _layer("wk_fro", "Frobenius norm of the layer's key projection.", "||Wk||_F", low=0.0),
    _layer("wk_spec", "Spectral norm of the layer's key projection.", "||Wk||_2", low=0.0),
    _layer("wk_erank", "Effective rank of the layer's key projection.", "Effective rank of Wk", low=1.0),
    # attention, from the activations
    _layer(
        "attn_entropy",
        "Normalised attention entropy of the layer.",
        "Attention entropy",
        unit="ratio",
        low=0.0,
        high=1.0,
        prometheus="qkwatch_attn_entropy",
        colour="threshold",
        threshold="h_star",
        primary=True,
    ),
    _layer(
        "attn_entropy_nats",
        "Attention entropy of the layer, in nats.",
        "Attention entropy (nats)",
        unit="nats",
        low=0.0,
    ),
    _layer(
        "attn_top1",
        "Largest attention probability of a row, averaged.",
        "Top-1 attention",
        unit="ratio",
        low=0.0,
        high=1.0,
    ),
    _layer(
        "attn_top5",
        "Mass of the five largest attention probabilities of a row.",
        "Top-5 attention",
        unit="ratio",
        low=0.0,
        high=1.0,
    ),
    _layer(
        "attn_gap",
        "Gap between a row's two largest attention probabilities.",
        "Top-1 - top-2",
        unit="ratio",
        low=0.0,
        high=1.0,
    ),
    _layer("logit_mean", "Mean scaled attention logit over the sampled rows.", "Mean attention logit"),
    _layer("logit_std", "Standard deviation of the scaled attention logits.", "Attention logit spread", low=0.0),
    _layer(
        "logit_max",
        "Largest scaled attention logit q.k/sqrt(d_head) of the layer's sampled rows.",
        "Largest attention logit",
        prometheus="qkwatch_attn_logit_max",
        primary=True,
    ),
    _layer("qk_erank", "Effective rank of the head's raw Q K^T (seed 001).", "Effective rank of QK^T", low=1.0),
    _layer("attn_srank", "Stable rank of the attention matrix (seed 003).", "Attention stable rank", low=1.0),
    _layer(
        "attn_gap1",
        "Spectral gap sigma_1 - sigma_2 of the attention matrix (seed 003).",
        "Attention spectral gap",
        low=0.0,
    ),
    _layer("pr_q", "Participation ratio of the layer's queries.", "Query participation ratio", low=1.0),
    _layer("pr_k", "Participation ratio of the layer's keys.", "Key participation ratio", low=1.0),
    _layer("pr_gap", "pr_q - pr_k (seed 001's paired contrast).", "Participation ratio gap", colour="diverging"),
    # RAA
    _layer(
        "lambda",
        "RAA penalty weight the trainer applied to the layer.",
        "RAA lambda",
        low=0.0,
        prometheus="qkwatch_lambda",
        primary=True,
    ),
    _layer("par", "The PAR term the layer added to the loss.", "PAR", low=0.0),
    # the run
    _run("loss", "Training loss.", "Train loss", unit="nats", low=0.0, prometheus="qkwatch_train_loss"),
    _run("val_loss", "Held-out loss.", "Validation loss", unit="nats", low=0.0),
    _run("lr", "Learning rate.", "Learning rate", low=0.0),
    _run("grad_norm", "Gradient norm before clipping.", "Gradient norm", low=0.0),
    _run(
        "raa_flagged_fraction",
        "Fraction of layers RAA flags (PAR computed).",
        "Layers flagged by RAA",
        unit="ratio",
        low=0.0,
        high=1.0,
    ),
    _run(
        "lambda_source",
        "Where the lambdas came from: 0 the collector, 1 the local schedule.",
        "Lambda source",
        low=0.0,
        high=1.0,
    ),
    _run(
        "lambda_version", "The collector's version of the lambdas applied; -1 while local.", "Lambda version", low=-1.0
    ),
    # the agent's own health, one series per rank
    _run(
        "agent_queue_depth",
        "Reports the agent spooled that the collector has not acknowledged yet.",
        "Queue depth",
        unit="count",
        low=0.0,
        prometheus="qkwatch_agent_queue_depth",
        per_rank=True,
    ),
    _run(
        "agent_spool_bytes",
        "Bytes the agent spooled to disk, undelivered.",
        "Spool on disk",
        unit="bytes",
        low=0.0,
        prometheus="qkwatch_agent_spool_bytes",
        per_rank=True,
    ),
    _run(
        "agent_step_overhead_seconds",
        "Seconds the agent added to the training step.",
        "Step overhead",
        unit="seconds",
        low=0.0,
        prometheus="qkwatch_agent_step_overhead_seconds",
        per_rank=True,
    ),
    _run(
        "agent_sent_total",
        "Reports the agent delivered.",
        "Deliveries",
        unit="count",
        low=0.0,
        prometheus="qkwatch_agent_sent",
        kind="counter",
        per_rank=True,
    ),
    _run(
        "agent_retried_total",
        "Deliveries the agent retried.",
        "Retries",
        unit="count",
        low=0.0,
        prometheus="qkwatch_agent_retried",
        kind="counter",
        per_rank=True,
    ),
    _run(
        "agent_dropped_total",
        "Reports the agent could not keep.",
        "Dropped",
        unit="count",
        low=0.0,
        prometheus="qkwatch_agent_dropped",
        kind="counter",
        per_rank=True,
    ),
    _run(
        "agent_dead_lettered_total",
        "Reports the collector refused for good (kept in the agent's dead-letter.jsonl).",
        "Dead letters",
        unit="count",
        low=0.0,
        prometheus="qkwatch_agent_dead_lettered",
        kind="counter",
        per_rank=True,
    ),
)

CATALOGUE: dict[str, Metric] = {m.name: m for m in _ENTRIES}
"""Every metric qkwatch names, by name, in the order pages list them."""


def register(metric: Metric) -> Metric:
    """Add ``metric`` to the catalogue (a metric of your own; its name must be new). Returns it."""
    if metric.name in CATALOGUE:
        raise ValueError(f"metric {metric.name!r} is already in the catalogue")
    CATALOGUE[metric.name] = metric
    return metric


def on_collapse_scale(name: str) -> bool:
    """Drawn on the colour scale that breaks at the collapse threshold (QKAI's)."""
    m = CATALOGUE.get(name)
    return m is not None and m.colour == "threshold" and m.threshold == "collapse"


def is_fraction(name: str) -> bool:
    """A value in [0, 1], drawn on that range."""
    m = CATALOGUE.get(name)
    return m is not None and m.low == 0 and m.high == 1


def layer_metrics() -> list[Metric]:
    """The per-layer metrics, the primary ones first."""
    return sorted((m for m in CATALOGUE.values() if m.scope == "layer"), key=lambda m: not m.primary)


def primary_layer_metrics() -> tuple[str, ...]:
    """The names of the primary per-layer metrics, in the catalogue's order: what the report's heatmaps,
    the sinks' heatmaps and the trainers' logs show by default (read when asked: a registered one counts)."""
    return tuple(m.name for m in layer_metrics() if m.primary)


def exported(scope: Scope, kind: Kind = "gauge") -> dict[str, tuple[str, str]]:
    """``{name: (Prometheus name, help)}`` of the catalogue's exported metrics of ``scope`` and ``kind``."""
    return {
        m.name: (m.prometheus, m.help())
        for m in CATALOGUE.values()
        if m.prometheus is not None and m.scope == scope and m.kind == kind
    }


def as_json() -> list[dict[str, object]]:
    """The catalogue as the live page reads it (``GET /ui/metrics.json``)."""
    return [
        {
            "name": m.name,
            "summary": m.summary,
            "display": m.display,
            "scope": m.scope,
            "unit": m.unit,
            "low": m.low,
            "high": m.high,
            "colour": m.colour,
            "threshold": m.threshold,
            "primary": m.primary,
        }
        for m in CATALOGUE.values()
    ]
