"""The Prometheus rows of the "qkwatch / run" dashboard: the run's latest values ("Now") and its agent's health.

Their queries are filtered by the run's labels (:data:`RUN_LABELS`); the dashboard around them is
:func:`qkwatch.dashboards.grafana.run_board.run_dashboard`.
"""

from __future__ import annotations

from typing import Any

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana.colours import qkai_steps, thresholds
from qkwatch.dashboards.grafana.layout import Layout
from qkwatch.dashboards.grafana.panels import panel, stat, timeseries
from qkwatch.dashboards.grafana.queries import promql

RUN_LABELS = 'project="$project", run="$run_name"'


def now_panels(lay: Layout, t: Thresholds) -> list[dict[str, Any]]:
    """The "Now" row: the run's latest values and their recent history, from Prometheus."""
    c = as_text(t.collapse)
    panels: list[dict[str, Any]] = []
    panels.append(lay.row("Now (Prometheus, running runs)"))
    panels.append(
        stat(
            lay,
            f"Layers above {c}",
            promql(f"qkwatch_collapsed_layers{{{RUN_LABELS}}}", "layers"),
            steps=[(None, "green"), (1, "orange"), (3, "red")],
            description="Layers whose latest QKAI exceeds the collapse threshold.",
        )
    )
    panels.append(
        stat(
            lay,
            "Collapse band (adjacent layers)",
            promql(f"qkwatch_collapse_band_layers{{{RUN_LABELS}}}", "band"),
            steps=[(None, "green"), (2, "orange"), (3, "red")],
            description=f"The widest run of adjacent layers above {c}; 3 or more is the collapse band "
            "(Prometheus alert QkwatchCollapseBand).",
        )
    )
    panels.append(
        stat(
            lay,
            "Last step",
            promql(f"qkwatch_last_step{{{RUN_LABELS}}}", "step"),
            description="Highest step the run reported.",
        )
    )
    panels.append(
        stat(
            lay,
            "Since the last report",
            promql(f"time() - qkwatch_last_report_timestamp_seconds{{{RUN_LABELS}}}", "lag"),
            unit="s",
            decimals=0,
            steps=[(None, "green"), (300, "orange"), (900, "red")],
            description="Seconds since the collector stored a report of the run (at 900 s the collector marks it "
            "crashed, reason stale).",
        )
    )
    panels.append(
        stat(
            lay,
            "Train loss",
            promql(f"qkwatch_train_loss{{{RUN_LABELS}}}", "loss"),
            decimals=3,
            description="Training loss, latest report.",
        )
    )
    panels.append(
        stat(
            lay,
            "Dead letters",
            promql(f"sum(qkwatch_agent_dead_lettered_total{{{RUN_LABELS}}})", "dead"),
            steps=[(None, "green"), (1, "red")],
            description="Reports the collector refused for good: the agent keeps them in its "
            "dead-letter.jsonl (summed over the run's ranks).",
        )
    )
    panels.append(
        panel(
            lay,
            "bargauge",
            "QKAI per layer, latest",
            24,
            6,
            [promql(f"qkwatch_qkai_ratio{{{RUN_LABELS}}}", "{{layer}}", instant=True)],
            description=f"Each layer's latest QKAI; the colours are the heatmap's, breaking at {c}.",
            defaults={
                "min": 0,
                "max": 1,
                "decimals": 2,
                "color": {"mode": "thresholds"},
                "thresholds": thresholds(qkai_steps(t)),
            },
            options={
                "displayMode": "basic",
                "orientation": "vertical",
                "showUnfilled": True,
                "valueMode": "color",
                "namePlacement": "auto",
                "sizing": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            },
        )
    )
    panels.append(
        timeseries(
            lay,
            "QKAI per layer",
            [promql(f"qkwatch_qkai_ratio{{{RUN_LABELS}}}", "layer {{layer}}")],
            steps=[(None, "transparent"), (t.collapse, "red")],
            min_value=0,
            description=f"Latest QKAI of each layer over time; above the dashed line ({c}) the "
            "area is red. Alert onsets are annotations.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Attention entropy per layer",
            [promql(f"qkwatch_attn_entropy{{{RUN_LABELS}}}", "layer {{layer}}")],
            steps=[(None, "transparent"), (t.h_star, "orange")],
            description="Normalised attention entropy of each layer over time.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Stable rank per layer",
            [promql(f"qkwatch_stable_rank{{{RUN_LABELS}}}", "layer {{layer}}")],
            description="Stable rank of Wq Wk^T of each layer over time.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "RAA lambda per layer",
            [promql(f"qkwatch_lambda{{{RUN_LABELS}}}", "layer {{layer}}")],
            unit="sci",
            description="RAA penalty weight of each layer over time.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Largest attention logit per layer",
            [promql(f"qkwatch_attn_logit_max{{{RUN_LABELS}}}", "layer {{layer}}")],
            description="Largest scaled attention logit of each layer over time (Prometheus alert "
            "QkwatchLogitGrowth: at least a few times its low of the last 6 hours).",
        )
    )
    return panels


def agent_panels(lay: Layout) -> list[dict[str, Any]]:
    """The "Agent health" row: each rank's agent's queue, spool, overhead and deliveries."""
    panels: list[dict[str, Any]] = []
    panels.append(lay.row("Agent health (Prometheus)"))
    per_rank = "rank {{rank}}"  # each training process's agent reports its own health
    panels.append(
        timeseries(
            lay,
            "Queue depth",
            [promql(f"qkwatch_agent_queue_depth{{{RUN_LABELS}}}", per_rank)],
            w=8,
            min_value=0,
            description="Reports the agent spooled that the collector has not acknowledged yet.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Report lag",
            [
                promql(
                    f"time() - qkwatch_last_report_timestamp_seconds{{{RUN_LABELS}}}", "seconds since the last report"
                )
            ],
            w=8,
            unit="s",
            min_value=0,
            steps=[(None, "transparent"), (300, "orange"), (900, "red")],
            description="Seconds since the collector last stored a report of the run.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Spool on disk",
            [promql(f"qkwatch_agent_spool_bytes{{{RUN_LABELS}}}", per_rank)],
            w=8,
            unit="bytes",
            min_value=0,
            description="Bytes of reports the agent spooled to disk and has not delivered yet.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Step overhead",
            [promql(f"qkwatch_agent_step_overhead_seconds{{{RUN_LABELS}}}", "rank {{rank}}")],
            w=8,
            unit="s",
            min_value=0,
            description="Seconds the agent added to a training step (mean since its previous report).",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Deliveries",
            [
                promql(f"rate(qkwatch_agent_sent_total{{{RUN_LABELS}}}[$__rate_interval])", "sent, rank {{rank}}", "A"),
                promql(
                    f"rate(qkwatch_agent_retried_total{{{RUN_LABELS}}}[$__rate_interval])",
                    "retried, rank {{rank}}",
                    "B",
                ),
            ],
            w=8,
            unit="reqps",
            min_value=0,
            description="Reports per second the agent delivered, and retries.",
        )
    )
    panels.append(
        timeseries(
            lay,
            "Dropped and dead-lettered",
            [
                promql(f"qkwatch_agent_dropped_total{{{RUN_LABELS}}}", "dropped (spool caps), rank {{rank}}", "A"),
                promql(f"qkwatch_agent_dead_lettered_total{{{RUN_LABELS}}}", "dead letters, rank {{rank}}", "B"),
            ],
            w=8,
            min_value=0,
            steps=[(None, "transparent"), (1, "red")],
            description="Reports the agent could not keep (spool caps), and reports the collector refused for good; "
            "both should stay 0.",
        )
    )
    return panels
