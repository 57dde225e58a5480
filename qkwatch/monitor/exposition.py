"""Prometheus exposition: run gauges read from the database on each scrape, plus service metrics.

The run gauges come from a custom :class:`Collector` in an app-owned registry that reads the
latest value per (run, layer) of *running* runs at scrape time, so several workers or replicas
behind one database all expose the same values, and a finished run drops out at once.

Labels: ``run`` is the run's **name** (readable in Grafana), with ``project`` beside it because a
name is unique only within its project; ``layer`` is the layer index; ``rank`` the training process
of an agent health series (see :data:`AGENT_SCALARS`). Never a step label.

The series count is bounded whatever the runs report: at most ``metrics_max_runs`` runs; per run
only the gauges named below, layers below ``metrics_max_layers``, ranks below ``metrics_max_ranks``,
and at most ``metrics_max_series_per_run`` layer and scalar series (layers before ranks), beside
the run's own gauges. What a run reported and the scrape leaves out is counted in
``qkwatch_run_series_dropped``, never dropped silently.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qkwatch.contract import metrics as catalogue
from qkwatch.contract.names import AGENT_SCALARS, agent_rank
from qkwatch.contract.thresholds import as_text
from qkwatch.monitor.settings import Settings
from qkwatch.monitor.store.models import LatestRow, RunRow
from qkwatch.monitor.store.store import Store

logger = logging.getLogger(__name__)

SeriesKey = tuple[int, int, str]
"""Where a series stands in a run's export order: (kind: 0 run scalar, 1 layer, 2 rank; layer or rank; metric)."""


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
        # read at every scrape: a metric added to the catalogue is exported with no other change
        layer_gauges, scalar_gauges = catalogue.exported("layer"), catalogue.exported("run")
        scalar_counters = catalogue.exported("run", "counter")
        try:
            names = [*layer_gauges, *scalar_gauges, *scalar_counters]
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
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            metric: GaugeMetricFamily(name, doc, labels=["project", "run", "layer"])
            for metric, (name, doc) in layer_gauges.items()
        }
        families.update(
            {
                metric: GaugeMetricFamily(name, doc, labels=_scalar_labels(metric))
                for metric, (name, doc) in scalar_gauges.items()
            }
        )
        families.update(
            {
                metric: CounterMetricFamily(name, doc, labels=_scalar_labels(metric))
                for metric, (name, doc) in scalar_counters.items()
            }
        )
        by_run: dict[tuple[str, str], list[LatestRow]] = defaultdict(list)
        collapsed: dict[tuple[str, str], list[int]] = defaultdict(list)
        threshold = self.settings.collapse_threshold
        for r in rows:
            by_run[(r.project, r.run_name)].append(r)
            if r.metric == "qkai" and r.layer >= 0 and not math.isnan(r.value) and r.value > threshold:
                collapsed[(r.project, r.run_name)].append(r.layer)
        layers = frozenset(layer_gauges)
        dropped = {run: self._export_run(run_rows, families, layers) for run, run_rows in by_run.items()}
        yield from families.values()
        yield from self._run_gauges(runs, collapsed, dropped)

    def _export_run(
        self,
        rows: list[LatestRow],
        families: dict[str, GaugeMetricFamily | CounterMetricFamily],
        layers: frozenset[str],
    ) -> int:
        """Add one run's series to ``families``, in export order up to the per-run cap; returns how
        many of ``rows`` were left out (a rank at or over the cap, a malformed rank, past the cap, a
        value of the wrong kind such as the loss sent per layer)."""
        series = [s for r in rows if (s := self._series(r, layers, families.keys() - layers)) is not None]
        series.sort(key=lambda s: s[0])
        kept = series[: self.settings.metrics_max_series_per_run]
        for _, metric, labels, value in kept:
            families[metric].add_metric(labels, value)
        return len(rows) - len(kept)

    def _series(
        self, r: LatestRow, layers: AbstractSet[str], scalars: AbstractSet[str]
    ) -> tuple[SeriesKey, str, list[str], float] | None:
        """The series a latest row is exported as: (export order, metric, labels, value); None: not exported
        (a name the catalogue does not export, or exports at the other scope: the loss sent per layer)."""
        if r.layer >= 0:
            if r.metric not in layers:
                return None
            return (1, r.layer, r.metric), r.metric, [r.project, r.run_name, str(r.layer)], r.value
        metric, rank = agent_rank(r.metric)
        if metric not in scalars:
            return None
        if metric not in AGENT_SCALARS:
            return (0, 0, metric), metric, [r.project, r.run_name], r.value
        if not 0 <= rank < self.settings.metrics_max_ranks:
            return None
        return (2, rank, metric), metric, [r.project, r.run_name, str(rank)], r.value

    def _run_gauges(
        self, runs: list[RunRow], collapsed: dict[tuple[str, str], list[int]], dropped: dict[tuple[str, str], int]
    ) -> Iterator[Metric]:
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
        left_out = GaugeMetricFamily(
            "qkwatch_run_series_dropped",
            "Latest values of the run this scrape left out: agent series of a rank at or above "
            f"{self.settings.metrics_max_ranks} (or a malformed rank), series past "
            f"{self.settings.metrics_max_series_per_run} per run, values of the wrong kind.",
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
            left_out.add_metric(labels, dropped.get((run.project, run.name), 0))
        yield from (n, band, step, seen, left_out)


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
