"""The "qkwatch / runs" dashboard: every run with its worst layer and collapse band, and two runs compared."""

from __future__ import annotations

from typing import Any

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana.cells import alert_state_cells, colour_cells, status_cells, time_cells
from qkwatch.dashboards.grafana.colours import qkai_steps, thresholds
from qkwatch.dashboards.grafana.dashboard import dashboard
from qkwatch.dashboards.grafana.layout import Layout
from qkwatch.dashboards.grafana.panels import band_matrix, panel, stat, table
from qkwatch.dashboards.grafana.queries import sql
from qkwatch.dashboards.grafana.variables import RUNS_BY_ACTIVITY, custom_variable, query_variable


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
