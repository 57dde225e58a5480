"""Prometheus exposition: run gauges read from the database on each scrape, plus service metrics.

The run gauges come from a custom :class:`Collector` in an app-owned registry that reads the
latest value per (run, layer) of *running* runs at scrape time, so several workers or replicas
behind one database all expose the same values, and a finished run drops out at once.

Labels: ``run`` is the run's **name** (readable in Grafana), with ``project`` beside it because a
name is unique only within its project; ``layer`` is the layer index; ``rank`` the training process
of an agent health series (see :data:`AGENT_SCALARS`). Never a step label. The
series count is bounded by ``metrics_max_runs`` x ``metrics_max_layers`` x the fixed gauge set.
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.models import RunRow
from qkwatch.monitor.store.store import Store
from qkwatch.monitor.thresholds import as_text

logger = logging.getLogger(__name__)

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
``rank`` label (``"0"`` for a single-process run's unsuffixed series)."""
_RANKED = re.compile(r"^(agent_\w+?)_rank(\d+)$")


def agent_rank(metric: str) -> tuple[str, str]:
    """``("agent_dropped_total", "3")`` for ``agent_dropped_total_rank3``; ``(metric, "0")`` otherwise."""
    ranked = _RANKED.match(metric)
    return (ranked.group(1), ranked.group(2)) if ranked else (metric, "0")


def _scalar_labels(metric: str) -> list[str]:
    return ["project", "run", "rank"] if metric in AGENT_SCALARS else ["project", "run"]


class RunCollector(Collector):
    """Reads a snapshot of the running runs' latest values (of ``projects``, None = all) from the store."""

    def __init__(self, store: Store, settings: Settings, projects: Sequence[str] | None = None) -> None:
        self.store = store
        self.settings = settings
        self.projects = projects

    def describe(self) -> list[Metric]:
        return []  # values are only known at scrape time; skip the registration-time collect()

    def collect(self) -> Iterator[Metric]:
        try:
            names = [*LAYER_GAUGES, *SCALAR_GAUGES, *SCALAR_COUNTERS]
            runs, rows = self.store.latest_snapshot(
                names,
                self.settings.metrics_max_runs,
                self.settings.metrics_max_layers,
                self.projects,
                prefixes=[f"{n}_rank" for n in AGENT_SCALARS],
            )
        except Exception:  # a scrape must not fail because the database is briefly away
            logger.exception("could not read the run snapshot for /metrics")
            return
        families = {
            metric: GaugeMetricFamily(name, doc, labels=["project", "run", "layer"])
            for metric, (name, doc) in LAYER_GAUGES.items()
        }
        scalars: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            metric: GaugeMetricFamily(name, doc, labels=_scalar_labels(metric))
            for metric, (name, doc) in SCALAR_GAUGES.items()
        }
        scalars.update(
            {
                metric: CounterMetricFamily(name, doc, labels=_scalar_labels(metric))
                for metric, (name, doc) in SCALAR_COUNTERS.items()
            }
        )
        collapsed: dict[tuple[str, str], list[int]] = defaultdict(list)
        for r in rows:
            if r.layer < 0:
                metric, rank = agent_rank(r.metric)
                if metric in scalars:
                    extra = [rank] if metric in AGENT_SCALARS else []
                    scalars[metric].add_metric([r.project, r.run_name, *extra], r.value)
                continue
            if r.metric not in families:
                continue
            families[r.metric].add_metric([r.project, r.run_name, str(r.layer)], r.value)
            if r.metric == "qkai" and not math.isnan(r.value) and r.value > self.settings.collapse_threshold:
                collapsed[(r.project, r.run_name)].append(r.layer)
        yield from families.values()
        yield from scalars.values()
        yield from self._run_gauges(runs, collapsed)

    def _run_gauges(self, runs: list[RunRow], collapsed: dict[tuple[str, str], list[int]]) -> Iterator[Metric]:
        threshold = as_text(self.settings.collapse_threshold)
        n = GaugeMetricFamily(
            "qkwatch_collapsed_layers", f"Layers whose latest qkai exceeds {threshold}.", labels=["project", "run"]
        )
        band = GaugeMetricFamily(
            "qkwatch_collapse_band_layers",
            f"Widest run of adjacent layers whose latest qkai exceeds {threshold}.",
            labels=["project", "run"],
        )
        step = GaugeMetricFamily("qkwatch_last_step", "Highest step reported by the run.", labels=["project", "run"])
        seen = GaugeMetricFamily(
            "qkwatch_last_report_timestamp_seconds",
            "Unix time the collector last stored a report of the run.",
            labels=["project", "run"],
        )
        for run in runs:
            labels = [run.project, run.name]
            layers = collapsed.get((run.project, run.name), [])
            n.add_metric(labels, len(layers))
            band.add_metric(labels, widest_band(layers))
            if run.last_step is not None:
                step.add_metric(labels, run.last_step)
            if run.last_report_at is not None:
                seen.add_metric(labels, run.last_report_at)
        yield from (n, band, step, seen)


def widest_band(layers: Iterable[int]) -> int:
    """Length of the longest run of consecutive layer indices, 0 for none: [1, 3, 4, 5, 7] -> 3.

    PromQL cannot see that layers are adjacent, so the collapse band (seed 000: >= 3 adjacent
    layers above the threshold) is measured here and alerted on as one number per run.
    """
    best = width = 0
    previous = None
    for layer in sorted(set(layers)):
        width = width + 1 if previous is not None and layer == previous + 1 else 1
        best, previous = max(best, width), layer
    return best


class ServiceMetrics:
    """The collector's own counters and histograms (per process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.points = Counter("qkwatch_points_ingested", "Points stored.", registry=registry)
        self.duplicates = Counter(
            "qkwatch_points_duplicate", "Points received again and not stored twice.", registry=registry
        )
        self.rejected = Counter(
            "qkwatch_requests_rejected", "Requests refused, by reason.", ["reason"], registry=registry
        )
        self.duration = Histogram(
            "qkwatch_request_duration_seconds",
            "Time to answer a request, by route.",
            ["method", "route"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.server_errors = Counter(
            "qkwatch_http_server_errors",
            "Requests answered with a 5xx, by route.",
            ["method", "route"],
            registry=registry,
        )

    def ingested(self, inserted: int, duplicates: int) -> None:
        self.points.inc(inserted)
        self.duplicates.inc(duplicates)


REJECT_REASONS = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    413: "too_large",
    422: "invalid",
    429: "rate_limited",
}


def build_registry() -> tuple[CollectorRegistry, ServiceMetrics]:
    """A fresh registry owned by one app, of its service metrics (the run gauges are read per scrape)."""
    registry = CollectorRegistry(auto_describe=False)
    return registry, ServiceMetrics(registry)


class Scrape:
    """What one scrape shows: the run gauges of ``projects`` (None = all; a token sees its own) and
    the service metrics of ``registry``. ``generate_latest`` takes it as a registry."""

    def __init__(
        self, registry: CollectorRegistry, store: Store, settings: Settings, projects: Sequence[str] | None
    ) -> None:
        self.registry = registry
        self.runs = RunCollector(store, settings, projects)

    def collect(self) -> Iterator[Metric]:
        yield from self.runs.collect()
        yield from self.registry.collect()
