"""qkwatch's Grafana dashboards and provisioning files, as plain dicts rendered to stable JSON/YAML.

``python -m qkwatch.dashboards.generate`` writes them (with the Prometheus rules); the committed files are
what Grafana provisions (docker-compose.yml) and what ``qkwatch dashboards push`` uploads, and
tests/dashboards/test_grafana_generator.py holds them equal to :func:`render`'s output. The collapse
threshold and H* (colour breaks, titles, descriptions, the SQL that counts collapsed layers) come from
the :class:`~qkwatch.contract.thresholds.Thresholds` given to :func:`render`.

Every SQL query reads the views of migration 0004 (``qkwatch_*_v``), never the tables, and uses
no Grafana macro: points carry steps, not times, so history panels are by step (table heatmaps
and trend panels whose x axis is the step) and the time picker governs only the Prometheus panels
and the annotations. Template variables are the only substitutions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import yaml

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana.grafana_panels import (
    Layout,
    alert_state_cells,
    band_matrix,
    colour_cells,
    custom_variable,
    dashboard,
    layer_trend,
    panel,
    promql,
    query_variable,
    sql,
    sql_annotation,
    stat,
    status_cells,
    table,
    thresholds,
    time_cells,
    timeseries,
)
from qkwatch.monitor import colour_scale
from qkwatch.monitor.dashboards import (
    FOLDER_TITLE,
    FOLDER_UID,
    POSTGRES_UID,
    DataSources,
    datasources,
)

GRAFANA_DASHBOARDS = "/var/lib/grafana/dashboards/qkwatch"
"""Where docker-compose.yml mounts qkwatch/dashboards/grafana/dashboards inside the Grafana container."""

# Discrete colour steps around a threshold t, as offsets from t, on the live page's scale
# (qkwatch.monitor.colour_scale): light and calm far below t, straw from 0.15 below ("approaching"),
# orange to dark red above, so 0.68 and 0.72 never look alike around a break at 0.70.
QKAI_EDGES = (-0.35, -0.15, 0.0, 0.1, 0.2)
ENTROPY_EDGES = (-0.35, -0.15, 0.0, 0.1)


# --- shared by both dashboards -----------------------------------------------------------------------

RUNS_BY_ACTIVITY = (
    "SELECT project || ' / ' || run_name AS __text, run_id AS __value FROM qkwatch_runs_v\n"
    "ORDER BY coalesce(last_report_at, created_at) DESC"
)


# --- qkwatch / run ------------------------------------------------------------------------------

RUN_LABELS = 'project="$project", run="$run_name"'


def qkai_steps(t: Thresholds) -> list[tuple[float | None, str]]:
    return colour_scale.discrete(t.collapse, QKAI_EDGES)


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


# --- qkwatch / runs ---------------------------------------------------------------------------


def runs_table(t: Thresholds) -> str:
    """Every run with its worst layer and widest band of adjacent layers above the collapse threshold."""
    return f"""WITH q AS (
  SELECT run_id, layer, value FROM qkwatch_latest_v WHERE metric = 'qkai' AND layer >= 0
), worst AS (
  SELECT DISTINCT ON (run_id) run_id, layer AS worst_layer, value AS worst_qkai
  FROM q WHERE value IS NOT NULL ORDER BY run_id, value DESC, layer
), islands AS (
  SELECT run_id, layer, layer - row_number() OVER (PARTITION BY run_id ORDER BY layer) AS island
  FROM q WHERE value > {as_text(t.collapse)}
), band AS (
  SELECT DISTINCT ON (run_id) run_id, count(*) AS band_width, min(layer) || '-' || max(layer) AS band_layers
  FROM islands GROUP BY run_id, island ORDER BY run_id, count(*) DESC, min(layer)
)
SELECT r.project, r.run_name, r.status, r.status_reason AS reason, r.attempt, r.last_step,
       r.last_report_at * 1000 AS last_report, w.worst_layer, w.worst_qkai,
       coalesce(b.band_width, 0) AS band_width, b.band_layers, r.tags, r.run_id
FROM qkwatch_runs_v r
LEFT JOIN worst w ON w.run_id = r.run_id
LEFT JOIN band b ON b.run_id = r.run_id
ORDER BY coalesce(r.last_report_at, r.created_at) DESC"""


def compare_trend(layout: Layout, title: str, where: str, *, description: str, w: int = 12) -> dict[str, Any]:
    query = f"""SELECT step,
       max(value) FILTER (WHERE run_id = '$run_a') AS run_a,
       max(value) FILTER (WHERE run_id = '$run_b') AS run_b
FROM qkwatch_points_v
WHERE run_id IN ('$run_a', '$run_b') AND metric = '$metric' AND head = -1 AND {where}
GROUP BY step ORDER BY step"""
    defaults = {
        "custom": {
            "drawStyle": "line",
            "lineWidth": 2,
            "showPoints": "never",
            "spanNulls": True,
            "fillOpacity": 0,
            "thresholdsStyle": {"mode": "off"},
        },
        "color": {"mode": "palette-classic"},
        "thresholds": thresholds([(None, "transparent")]),
    }
    return panel(
        layout,
        "trend",
        title,
        w,
        8,
        [sql(query)],
        description=description,
        defaults=defaults,
        overrides=[
            {
                "matcher": {"id": "byName", "options": "run_a"},
                "properties": [{"id": "displayName", "value": "A: ${run_a:text}"}],
            },
            {
                "matcher": {"id": "byName", "options": "run_b"},
                "properties": [{"id": "displayName", "value": "B: ${run_b:text}"}],
            },
        ],
        options={
            "xField": "step",
            "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
    )


def runs_dashboard(t: Thresholds) -> dict[str, Any]:
    c = as_text(t.collapse)
    lay = Layout()
    panels: list[dict[str, Any]] = [lay.row("All runs")]
    panels.append(
        stat(
            lay,
            "Running",
            sql("SELECT count(*) AS running FROM qkwatch_runs_v WHERE status = 'running'"),
            description="Runs reporting now (or not yet marked stale).",
            w=8,
            h=3,
        )
    )
    panels.append(
        stat(
            lay,
            "Runs with a collapse band",
            sql(f"""SELECT count(DISTINCT run_id) AS runs FROM (
  SELECT run_id FROM (
    SELECT run_id, layer - row_number() OVER (PARTITION BY run_id ORDER BY layer) AS island
    FROM qkwatch_latest_v WHERE metric = 'qkai' AND layer >= 0 AND value > {c}
  ) i GROUP BY run_id, island HAVING count(*) >= 3
) b"""),
            w=8,
            h=3,
            steps=[(None, "green"), (1, "red")],
            description=f"Runs whose latest QKAI exceeds {c} on 3 or more adjacent layers.",
        )
    )
    panels.append(
        stat(
            lay,
            "Firing alerts",
            sql("SELECT count(*) AS firing FROM qkwatch_alerts_v WHERE state = 'firing'"),
            w=8,
            h=3,
            steps=[(None, "green"), (1, "red")],
            description="The collector's alerts that are firing, over all runs.",
        )
    )
    panels.append(
        table(
            lay,
            "Runs",
            runs_table(t),
            h=10,
            description="Every run, latest activity first. worst_layer and worst_qkai: the layer with "
            "the highest latest QKAI; band_width: the most adjacent layers whose latest "
            f"QKAI is above {c} (3 or more is a collapse band), band_layers which ones; tags: the "
            "run's tags, comma-separated. The run name links to qkwatch / run.",
            overrides=[
                status_cells(),
                *time_cells("last_report"),
                colour_cells("worst_qkai", qkai_steps(t)),
                colour_cells("band_width", [(None, "green"), (1, "orange"), (3, "red")]),
                {
                    "matcher": {"id": "byName", "options": "run_name"},
                    "properties": [
                        {
                            "id": "links",
                            "value": [
                                {
                                    "title": "qkwatch / run",
                                    "url": "/d/qkwatch-run/qkwatch-run?var-run=${__data.fields.run_id}",
                                }
                            ],
                        }
                    ],
                },
            ],
        )
    )
    panels.append(
        table(
            lay,
            "Open alerts: firing, or firing when their run ended",
            """SELECT project, run_name, state, rule, severity, layers, onset_step, ended_step, run_end,
       last_values, predicted_step, starts_at * 1000 AS starts, summary
FROM qkwatch_alerts_v WHERE state IN ('firing', 'ended')
ORDER BY CASE state WHEN 'firing' THEN 0 ELSE 1 END, starts_at DESC""",
            h=6,
            description="The collector's alerts that nothing resolved, over all runs, of every rule it runs: "
            "firing ones first, then those still firing when their run ended (run ended while firing: "
            "ended_step is the run's last step, run_end how it ended, last_values the metric on each of "
            "the alert's layers then). A forecast's predicted_step is the step at which it expects the crossing.",
            overrides=[*time_cells("starts"), alert_state_cells()],
        )
    )

    panels.append(lay.row("Compare run A with run B"))
    panels.append(
        compare_trend(
            lay,
            "$metric, highest layer per step: A vs B",
            "layer >= 0",
            description="Per step, the highest value over the layers (for QKAI: the worst layer), for the two runs.",
        )
    )
    panels.append(
        compare_trend(
            lay,
            "$metric at layer $layer: A vs B",
            "layer = $layer",
            description="One layer's value over steps, for the two runs.",
        )
    )
    panels.append(
        panel(
            lay,
            "barchart",
            "Latest $metric per layer: A vs B",
            24,
            7,
            [
                sql("""SELECT 'layer ' || l.layer AS layer,
       max(l.value) FILTER (WHERE l.run_id = '$run_a') AS run_a,
       max(l.value) FILTER (WHERE l.run_id = '$run_b') AS run_b
FROM qkwatch_latest_v l
WHERE l.run_id IN ('$run_a', '$run_b') AND l.metric = '$metric' AND l.layer >= 0
GROUP BY l.layer ORDER BY l.layer""")
            ],
            description="Each layer's latest value in the two runs.",
            defaults={"color": {"mode": "palette-classic"}, "decimals": 2},
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "run_a"},
                    "properties": [{"id": "displayName", "value": "A: ${run_a:text}"}],
                },
                {
                    "matcher": {"id": "byName", "options": "run_b"},
                    "properties": [{"id": "displayName", "value": "B: ${run_b:text}"}],
                },
            ],
            options={
                "xField": "layer",
                "orientation": "auto",
                "groupWidth": 0.7,
                "barWidth": 0.9,
                "showValue": "never",
                "stacking": "none",
                "legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                "tooltip": {"mode": "multi", "sort": "none"},
            },
        )
    )
    qkai = {"color": {"mode": "thresholds"}, "thresholds": thresholds(qkai_steps(t))}
    description = f"QKAI per layer (rows) and step (columns, at most $columns); the colours break at {c}."
    panels.append(band_matrix(lay, "A: QKAI per layer and step", "$run_a", "qkai", qkai, description=description, w=12))
    panels.append(band_matrix(lay, "B: QKAI per layer and step", "$run_b", "qkai", qkai, description=description, w=12))

    variables = [
        query_variable("run_a", "run A", RUNS_BY_ACTIVITY),
        query_variable("run_b", "run B", RUNS_BY_ACTIVITY),
        custom_variable("metric", "metric", ["qkai", "attn_entropy", "stable_rank", "lambda"], "qkai"),
        query_variable(
            "layer",
            "layer",
            """SELECT DISTINCT layer FROM qkwatch_latest_v
WHERE run_id IN ('$run_a', '$run_b') AND metric = '$metric' AND layer >= 0 ORDER BY layer""",
        ),
        custom_variable("columns", "step columns", ["20", "40", "80"], "20"),
    ]
    return dashboard(
        "qkwatch-runs",
        "qkwatch / runs",
        "Every run with its status, worst layer and collapse band width; two runs side by side.",
        panels,
        variables,
    )


# --- provisioning and output --------------------------------------------------------------------

DASHBOARDS = {"run.json": run_dashboard, "runs.json": runs_dashboard}


def provisioning() -> dict[str, dict[str, Any]]:
    """Grafana's provisioning files for docker-compose.yml (service names postgres and prometheus)."""
    sources = datasources(DataSources(password="$QKWATCH_GRAFANA_DB_PASSWORD"))
    for ds in sources:
        ds["editable"] = False
    sources[1]["isDefault"] = True
    providers = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "qkwatch",
                "orgId": 1,
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 30,
                "options": {"path": GRAFANA_DASHBOARDS, "foldersFromFilesStructure": False},
            }
        ],
    }
    return {
        "provisioning/datasources/qkwatch.yml": {"apiVersion": 1, "datasources": sources},
        "provisioning/dashboards/qkwatch.yml": providers,
    }


YAML_HEADER = (
    "# Generated by `python -m qkwatch.dashboards.generate` (qkwatch/dashboards/grafana/boards.py);"
    " edit that, then run it.\n"
)


def render(thresholds: Thresholds) -> dict[str, str]:
    """Relative path (under qkwatch/dashboards/grafana) -> the file's exact text."""
    out = {f"dashboards/{name}": json.dumps(make(thresholds), indent=2) + "\n" for name, make in DASHBOARDS.items()}
    for path, data in provisioning().items():
        out[path] = YAML_HEADER + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    return out


def iter_queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, datasource uid, query text) of every query: variables, annotations and panel targets."""
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            yield f"variable {var['name']}", var["datasource"]["uid"], var["query"]
    for anno in board["annotations"]["list"]:
        if "target" in anno:
            yield f"annotation {anno['name']}", anno["datasource"]["uid"], anno["target"]["rawSql"]
    for p in board["panels"]:
        for t in p.get("targets", []):
            uid = t["datasource"]["uid"]
            yield f"panel {p['title']!r} {t['refId']}", uid, t["rawSql"] if uid == POSTGRES_UID else t["expr"]
