"""The HTML page of ``qkwatch report``: plotly.js inlined once, then a section per part of the run(s).

Each section lays out the figures of ``monitor.report_figures`` and the tables whose cells are
``monitor.report_cells``; with two runs (``--vs``) the runs stand side by side in each section.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable

from qkwatch.client.report_cells import (
    above_cell,
    alerts_cell,
    end_text,
    end_values,
    grid,
    highest_cell,
    last_cell,
    layers_text,
    notes_cell,
    num_cell,
    state_text,
    status_cell,
    table,
    tags_cell,
    time_text,
)
from qkwatch.client.report_figures import (
    Figure,
    Json,
    RunData,
    colour_scale,
    heatmap_figure,
    lambdas_figure,
    latest_figure,
    layer_curves_figure,
    layer_range,
    loss_figure,
    step_range,
)
from qkwatch.contract import metrics as catalogue
from qkwatch.contract.thresholds import as_text

PLOT_CONFIG = {"displaylogo": False, "responsive": True}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.2rem 1.6rem; color: #222; max-width: 1600px; }
h1 { font-size: 1.35rem; margin: 0 0 0.3rem; } h2 { font-size: 1.1rem; margin: 1.6rem 0 0.5rem;
  border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; } h3 { font-size: 0.95rem; margin: 0.8rem 0 0.3rem; }
.meta { color: #555; font-size: 0.85rem; } nav { font-size: 0.85rem; margin: 0.4rem 0; }
nav a { margin-right: 0.8rem; color: #2171b5; }
/* Fixed columns: each figure is drawn as its script is parsed, so its cell must have its final width by then. */
.grid { display: grid; grid-template-columns: repeat(var(--cols, 2), minmax(0, 1fr)); gap: 0.4rem 1rem; }
@media (max-width: 900px) { .grid { grid-template-columns: minmax(0, 1fr); } }
table.facts th:first-child { white-space: nowrap; } table.facts td { min-width: 16rem; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.3rem 0 0.6rem; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.2rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 700; font-size: 0.75rem; padding: 0 0.35rem; border-radius: 3px; text-transform: uppercase;
  white-space: nowrap; background: #ddd; color: #555; }
tr.firing td { background: #fdecea; color: #5f0010; } tr.firing .state { background: #b00020; color: #fff; }
tr.ended td { background: #fff1e0; color: #5c2d00; } tr.ended .state { background: #a04000; color: #fff; }
.ended-text { color: #a04000; font-weight: 600; }
.status-running { color: #1b7f3b; } .status-crashed { color: #b00020; } .status-finished { color: #666; }
.bad { color: #b00020; font-weight: 600; } .none { color: #666; font-style: italic; }
.tag { display: inline-block; background: #e8eef7; color: #1f3d7a; border-radius: 3px; padding: 0 0.4rem;
  margin: 0 0.3rem 0.15rem 0; font-size: 0.8rem; } .notes { white-space: pre-wrap; max-width: 48rem; }
pre { background: #f7f7f7; border: 1px solid #e4e4e4; padding: 0.6rem; font-size: 0.78rem; overflow: auto;
  max-height: 36rem; }
"""


def render(runs: list[RunData], *, threshold: float, source: str) -> str:
    """The whole HTML document: plotly.js inlined once, then the sections."""
    from plotly.offline import get_plotlyjs  # heavy; only here

    names = " vs ".join(r.label for r in runs)
    generated = time_text(time.time())
    sections = [
        summary_section(runs, threshold),
        heatmaps_section(runs, threshold),
        curves_section(runs, threshold),
        alerts_section(runs),
        lambdas_section(runs),
        config_section(runs),
    ]
    nav = "".join(f'<a href="#{anchor}">{title}</a>' for anchor, title in NAV)
    return (
        f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>qkwatch report: {html.escape(names)}</title>\n<style>{STYLE}</style>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n<body>\n'
        f"<h1>qkwatch report: {html.escape(names)}</h1>\n"
        f'<div class="meta">read from {html.escape(source)} at {generated}; collapse threshold '
        f"{as_text(threshold)}</div>\n<nav>{nav}</nav>\n{''.join(sections)}</body>\n</html>\n"
    )


NAV = (
    ("summary", "summary"),
    ("heatmaps", "band heatmaps"),
    ("layers", "qkai per layer"),
    ("loss", "loss"),
    ("alerts", "alerts"),
    ("lambdas", "lambdas"),
    ("config", "config"),
)


def plot(figure: Figure, div_id: str, height: int = 380) -> str:
    import plotly.io as pio

    html_div: str = pio.to_html(
        figure,
        include_plotlyjs=False,
        full_html=False,
        validate=False,
        config=PLOT_CONFIG,
        default_height=f"{height}px",
        div_id=div_id,
    )
    return html_div


def summary_section(runs: list[RunData], threshold: float) -> str:
    rows: list[tuple[str, Callable[[RunData], str]]] = [
        ("run id", lambda d: f"<code>{html.escape(d.run['id'])}</code>"),
        ("status", status_cell),
        ("tags", tags_cell),
        ("notes", notes_cell),
        ("attempt", lambda d: str(d.run["latest_attempt"])),
        ("last step", lambda d: str(d.run["last_step"])),
        ("created", lambda d: time_text(d.run["created_at"])),
        ("last report", lambda d: time_text(d.run["last_report_at"])),
        (f"layers above {as_text(threshold)} (latest qkai)", lambda d: above_cell(d, threshold)),
        ("highest latest qkai", lambda d: highest_cell(d)),
        ("alerts", alerts_cell),
        ("final train loss", lambda d: last_cell(d.loss)),
        ("final validation loss", lambda d: last_cell(d.val_loss)),
    ]
    head = "".join(f"<th>{html.escape(d.label)}</th>" for d in runs)
    body = "".join(
        f"<tr><th>{html.escape(name)}</th>{''.join(f'<td>{cell(d)}</td>' for d in runs)}</tr>" for name, cell in rows
    )
    figures = (
        f"<div>{plot(latest_figure(runs, threshold), 'fig-latest', 360)}</div>"
        f'<div id="loss">{plot(loss_figure(runs), "fig-loss", 360)}</div>'
    )
    return (
        f'<section id="summary"><h2>Summary</h2><table class="facts"><tr><th></th>{head}</tr>{body}</table>'
        f"{grid(figures, 2)}</section>\n"
    )


def heatmaps_section(runs: list[RunData], threshold: float) -> str:
    """A metric per row with the runs side by side (one run: two metrics per row), one scale per metric."""
    axes = step_range(runs), layer_range(runs)
    cells = []
    for metric in catalogue.primary_layer_metrics():
        scale = colour_scale(metric, [r.heatmaps[metric] for r in runs], threshold)
        cells += [
            plot(heatmap_figure(r, metric, scale, axes, threshold), f"fig-heatmap-{metric}-{i}")
            for i, r in enumerate(runs)
        ]
    return f'<section id="heatmaps"><h2>Band heatmaps</h2><div class="grid">{"".join(cells)}</div></section>\n'


def curves_section(runs: list[RunData], threshold: float) -> str:
    x_range = step_range(runs)
    cells = "".join(plot(layer_curves_figure(r, threshold, x_range), f"fig-layers-{i}") for i, r in enumerate(runs))
    return f'<section id="layers"><h2>QKAI per layer over steps</h2>{grid(cells, len(runs))}</section>\n'


STATE_ORDER = {"firing": 0, "ended": 1, "resolved": 2}


def alerts_section(runs: list[RunData]) -> str:
    """Per run: its alerts, firing first, then those its run ended with (their end and last values), then
    the resolved ones; each group newest first."""
    parts = []
    for d in runs:
        rows = [
            (
                f'class="{html.escape(a["state"])}"',
                [
                    f'<span class="state">{html.escape(state_text(a["state"]))}</span>',
                    html.escape(a["severity"]),
                    f"<b>{html.escape(a['rule'])}</b>",
                    layers_text(a["layers"]),
                    num_cell(a["onset_step"]),
                    html.escape(end_text(a)),
                    html.escape(end_values(a)),
                    time_text(a["starts_at"]),
                    html.escape(a["summary"]),
                ],
            )
            for a in _ordered(d.alerts)
        ]
        parts.append(
            f"<h3>{html.escape(d.label)}</h3>"
            + table(
                ["state", "severity", "rule", "layers", "onset step", "end", "last values", "since", "summary"],
                rows,
                empty="no alerts",
            )
        )
    return f'<section id="alerts"><h2>Alerts</h2>{"".join(parts)}</section>\n'


def _ordered(alerts: list[Json]) -> list[Json]:
    return sorted(alerts, key=lambda a: STATE_ORDER.get(a["state"], 3))  # stable: newest first within a state


def lambdas_section(runs: list[RunData]) -> str:
    parts = []
    for i, d in enumerate(runs):
        lam = d.lambdas
        schedule = lam.get("schedule") or {}
        floor = schedule.get("floor", 0) * schedule.get("lambda_0", 0)
        h = lam.get("h") or []
        rows = [
            (
                'class="lambda"',
                [
                    str(layer),
                    num_cell(v),
                    num_cell(lam["overrides"].get(str(layer))),
                    num_cell(h[layer] if layer < len(h) else None),
                    "yes" if floor and v > floor else "",
                ],
            )
            for layer, v in enumerate(lam["lambdas"])
        ]
        audit = [
            (
                'class="audit"',
                [
                    str(a["version"]),
                    num_cell(a["step"]),
                    str(a["layer"]),
                    num_cell(a["old"]),
                    num_cell(a["new"]),
                    html.escape(a["who"]),
                    time_text(a["at"]),
                ],
            )
            for a in d.audit
        ]
        parts.append(
            f"<div><h3>{html.escape(d.label)}</h3>{plot(lambdas_figure(d), f'fig-lambdas-{i}', 320)}"
            f"<div class='meta'>what the collector serves (source {html.escape(str(lam.get('source')))}; a run "
            f"applies them only with RAA on); schedule <code>{html.escape(json.dumps(schedule))}</code></div>"
            + table(
                ["layer", "lambda", "override", "running entropy H", "above the flag floor"],
                rows,
                empty="no layers yet",
            )
            + "<h3>override audit trail</h3>"
            + table(["version", "step", "layer", "old", "new", "who", "at"], audit, empty="no overrides")
            + "</div>"
        )
    return f'<section id="lambdas"><h2>Lambdas</h2>{grid("".join(parts), len(runs))}</section>\n'


def config_section(runs: list[RunData]) -> str:
    parts = "".join(
        f"<div><h3>{html.escape(d.label)}</h3><pre>{html.escape(json.dumps(d.run['config'], indent=2))}</pre></div>"
        for d in runs
    )
    return f'<section id="config"><h2>Config</h2>{grid(parts, len(runs))}</section>\n'
