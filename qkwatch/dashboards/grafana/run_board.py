"""The "qkwatch / run" dashboard: one run's collapse band, its latest values, its alerts and its agent's health.

Its history panels read the collector's database (PostgreSQL) by step; its "Now" and agent panels
read Prometheus, filtered by the run's labels (:data:`RUN_LABELS`).
"""

from __future__ import annotations

from typing import Any

from qkwatch.contract import colour_scale
from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana.cells import alert_state_cells, status_cells, time_cells
from qkwatch.dashboards.grafana.colours import ENTROPY_EDGES, qkai_steps, thresholds
from qkwatch.dashboards.grafana.dashboard import dashboard, sql_annotation
from qkwatch.dashboards.grafana.layout import Layout
from qkwatch.dashboards.grafana.panels import band_matrix, layer_trend, panel, stat, table, timeseries
from qkwatch.dashboards.grafana.queries import promql
from qkwatch.dashboards.grafana.variables import RUNS_BY_ACTIVITY, custom_variable, query_variable

RUN_LABELS = 'project="$project", run="$run_name"'


def run_dashboard(t: Thresholds) -> dict[str, Any]:
    c, h = as_text(t.collapse), as_text(t.h_star)
    lay = Layout()
    panels: list[dict[str, Any]] = [lay.row("Run")]
    panels.append(
        table(
            lay,
            "Run",
            """SELECT project, run_name, status, status_reason AS reason, attempt, last_step,
       created_at * 1000 AS created, last_report_at * 1000 AS last_report, run_id
FROM qkwatch_runs_v WHERE run_id = '$run'""",
            w=24,
            h=4,
            description="The run as the collector has it: status "
            "(running, finished, crashed) and why, the latest attempt (a resume starts a new one), the "
            "highest step reported.",
            overrides=[status_cells(), *time_cells("created", "last_report")],
        )
    )
    panels.append(
        table(
            lay,
            "Alerts of the run (collector)",
            """SELECT rule, severity, state, layers, onset_step, resolved_step, ended_step, run_end,
       last_values, predicted_step, starts_at * 1000 AS starts, ends_at * 1000 AS ends, summary
FROM qkwatch_alerts_v WHERE run_id = '$run' ORDER BY starts_at DESC""",
            h=6,
            description="The collector's own alerts (persistence counted in reports), of every rule "
            "it runs: by default qkai_high per layer and collapse_band for adjacent layers; with a "
            "rules file also thresholds on other metrics (stable rank, attention entropy), logit "
            "growth against the run's early value and forecasts. A forecast's predicted_step is the "
            "step at which it expected the crossing when it fired; its summary says why. An alert "
            "still firing when the run ended (finished, crashed or stale) is 'run ended while firing', "
            "never resolved: ended_step is the run's last step, run_end how it ended, last_values the "
            "metric on each of its layers then. Their onsets are annotations on the time series below.",
            overrides=[*time_cells("starts", "ends"), alert_state_cells()],
        )
    )

    panels.append(lay.row("Collapse band, by step (PostgreSQL)"))
    panels.append(
        band_matrix(
            lay,
            f"QKAI per layer and step (orange to red above {c})",
            "$run",
            "qkai",
            {"color": {"mode": "thresholds"}, "thresholds": thresholds(qkai_steps(t))},
            description=f"Query-key alignment index of each layer (rows) at each step (columns; at most $columns, a "
            f"column is a bucket of steps named by its first step and shows the bucket's maximum, so a band "
            f"is never averaged away). The colours break at {c}, the collapse threshold: light and "
            f"calm below, straw just under it, orange to dark red above.",
        )
    )
    panels.append(
        band_matrix(
            lay,
            f"Attention entropy per layer and step (orange above h_star {h})",
            "$run",
            "attn_entropy",
            {"color": {"mode": "thresholds"}, "thresholds": thresholds(colour_scale.discrete(t.h_star, ENTROPY_EDGES))},
            description=f"Normalised attention entropy (1 = uniform attention). A collapsed band climbs toward 1. "
            f"The break at {h} is the entropy-floor schedule's default h_star: above it RAA flags the "
            f"layer.",
        )
    )
    panels.append(
        band_matrix(
            lay,
            "Stable rank of Wq Wk^T per layer and step (red = low)",
            "$run",
            "stable_rank",
            {"color": {"mode": "continuous-RdYlGr"}, "thresholds": thresholds([(None, "green")])},
            description="Stable rank of the query-key product (mean over heads); it falls in a collapsing band. "
            "Continuous scale from the panel's minimum (red) to its maximum (green).",
            decimals=1,
        )
    )
    panels.append(
        band_matrix(
            lay,
            "RAA lambda per layer and step",
            "$run",
            "lambda",
            {"color": {"mode": "continuous-purples"}, "thresholds": thresholds([(None, "green")])},
            description="The penalty weight the trainer applied to each layer: the collector's entropy-floor "
            "schedule, an operator's override, or, while the collector is away, the same schedule "
            "computed by the agent (the run's lambda_source series says which). Empty for a run "
            "without RAA.",
            unit="sci",
            decimals=1,
        )
    )

    panels.append(lay.row("Per layer, by step (PostgreSQL)"))
    panels.append(
        layer_trend(
            lay,
            "QKAI",
            "$run",
            "qkai",
            steps=[(None, "transparent"), (t.collapse, "red")],
            description="Each layer's QKAI over steps (mean per bucket of at most 400); the "
            f"dashed line is the collapse threshold {c}.",
        )
    )
    panels.append(
        layer_trend(
            lay,
            "Attention entropy",
            "$run",
            "attn_entropy",
            steps=[(None, "transparent"), (t.h_star, "orange")],
            description=f"Each layer's normalised attention entropy; the dashed line is h_star ({h}).",
        )
    )
    panels.append(
        layer_trend(
            lay,
            "Stable rank of Wq Wk^T",
            "$run",
            "stable_rank",
            description="Each layer's stable rank of the query-key product.",
        )
    )
    panels.append(
        layer_trend(
            lay,
            "RAA lambda",
            "$run",
            "lambda",
            unit="sci",
            description="Each layer's RAA penalty weight (empty without RAA).",
        )
    )
    panels.append(
        layer_trend(
            lay,
            "Largest attention logit",
            "$run",
            "logit_max",
            w=24,
            description="Each layer's largest scaled attention logit q.k/sqrt(d_head) on the sampled rows. "
            "Many-fold growth over the run's early value precedes loss divergence (Wortsman et al. 2023); "
            "the collector's growth rules (e.g. logit_growth) compare each layer with its own early value.",
        )
    )

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

    variables = [
        query_variable("run", "run", RUNS_BY_ACTIVITY),
        query_variable("project", "project", "SELECT project FROM qkwatch_runs_v WHERE run_id = '$run'", hide=2),
        query_variable("run_name", "run name", "SELECT run_name FROM qkwatch_runs_v WHERE run_id = '$run'", hide=2),
        custom_variable("columns", "step columns", ["20", "40", "80", "160"], "40"),
    ]
    annotations = [
        sql_annotation(
            "Alerts (collector)",
            "red",
            """SELECT to_timestamp(starts_at) AS time,
       to_timestamp(coalesce(ends_at, extract(epoch FROM now()))) AS timeend,
       rule || ' (' || severity || ', ' || state || '), layers ' || layers || ', onset step ' || onset_step
         || coalesce(', predicted crossing step ' || predicted_step, '') || ': ' || summary AS text,
       rule || ',' || severity AS tags
FROM qkwatch_alerts_v WHERE run_id = '$run' ORDER BY starts_at""",
        ),
        sql_annotation(
            "Run events",
            "purple",
            """SELECT to_timestamp(time) AS time,
       kind || ' at step ' || step || ': ' || message AS text, kind AS tags
FROM qkwatch_events_v WHERE run_id = '$run' ORDER BY time""",
        ),
    ]
    return dashboard(
        "qkwatch-run",
        "qkwatch / run",
        "One run: its collapse band (layer x step heatmaps of QKAI, entropy, stable rank and lambda "
        "from the collector's database), the latest values from Prometheus, alerts, and the agent's "
        "health.",
        panels,
        variables,
        annotations,
    )
