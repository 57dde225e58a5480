"""The "qkwatch / run" dashboard: one run's collapse band, its latest values, its alerts and its agent's health.

Its history panels read the collector's database (PostgreSQL) by step; its "Now" and agent panels
read Prometheus (:mod:`qkwatch.dashboards.grafana.run_board_live`).
"""

from __future__ import annotations

from typing import Any

from qkwatch.contract import colour_scale
from qkwatch.contract import metrics as catalogue
from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana.cells import alert_state_cells, status_cells, time_cells
from qkwatch.dashboards.grafana.colours import ENTROPY_EDGES, qkai_steps, thresholds
from qkwatch.dashboards.grafana.dashboard import dashboard, sql_annotation
from qkwatch.dashboards.grafana.layout import Layout
from qkwatch.dashboards.grafana.panels import band_matrix, layer_trend, table
from qkwatch.dashboards.grafana.run_board_live import agent_panels, now_panels
from qkwatch.dashboards.grafana.variables import RUNS_BY_ACTIVITY, custom_variable, query_variable

DRAWN_ABOVE = frozenset({"qkai", "attn_entropy", "stable_rank", "lambda", "logit_max"})
"""The catalogue's primary metrics the board draws with panels of their own (the rest: a trend panel each)."""


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
    # every other primary metric of the catalogue: one trend panel each, titled and described by its entry
    for metric in catalogue.layer_metrics():
        if metric.primary and metric.name not in DRAWN_ABOVE:
            panels.append(
                layer_trend(
                    lay,
                    metric.display,
                    "$run",
                    metric.name,
                    w=24,
                    description=f"{metric.summary} Each layer's value over steps (mean per bucket of at most 400).",
                )
            )

    panels += now_panels(lay, t)
    panels += agent_panels(lay)

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
