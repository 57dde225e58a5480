"""The figures of ``qkwatch report``: plotly figure dicts drawn from :class:`RunData`, the runs as read.

Band heatmaps on one colour scale per metric across runs (QKAI's breaks at the collapse threshold, as on
the live page), QKAI per layer over steps, the latest QKAI per layer, the loss and the lambdas. Pure: dicts
in, dicts out; ``monitor.report_data`` reads the collector and ``monitor.report_html`` lays the page out.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from typing import Any

from qkwatch.contract import metrics as catalogue
from qkwatch.contract.colour_scale import GAP, colorscale
from qkwatch.contract.thresholds import as_text
from qkwatch.contract.values import decode_value

RUN_COLORS = ("#1b9e77", "#7570b3", "#e7298a", "#66a61e")
LAYER_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
STATUS_COLORS = {"running": "#1b7f3b", "crashed": "#b00020", "finished": "#666"}


Json = dict[str, Any]
"""A JSON object as the collector sent it: wire values ("nan" strings), times in epoch seconds."""
Figure = dict[str, Any]
"""A plotly figure (or part of one) as a dict."""


@dataclass
class RunData:
    """Everything the report shows of one run, as the API returned it (wire values)."""

    run: Json
    heatmaps: dict[str, Json]
    latest: dict[int, tuple[float, int]]
    """Each layer's last finite QKAI and its step."""
    loss: Json
    val_loss: Json
    alerts: list[Json]
    lambdas: Json
    audit: list[Json]

    @property
    def label(self) -> str:
        return visible(f"{self.run['project']}/{self.run['name']}")


BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Bidi controls: shown as what they are, so that no run name can pass for another (as on the live page)."""


def visible(text: str) -> str:
    """``text`` with each bidi control replaced by ``[U+202E]`` and the like."""
    return BIDI.sub(lambda m: f"[U+{ord(m.group()):04X}]", text)


def finite(value: Any) -> float | None:
    """A wire value as a float, or None for "not measured" and nan/inf (a gap in a plot)."""
    v = decode_value(value)
    return v if v is not None and math.isfinite(v) else None


# ---- colour scales ------------------------------------------------------------------------------


def colour_scale(metric: str, heatmaps: list[Json], threshold: float) -> Figure:
    """One scale for a metric across runs: [0, 1] for unit metrics, else the data's extent."""
    lo, hi = (0.0, 1.0) if catalogue.is_fraction(metric) else _extent(heatmaps)
    if metric == "lambda":
        lo = min(0.0, lo)
    if catalogue.on_collapse_scale(metric) and lo < threshold < hi:
        return threshold_scale(lo, hi, threshold)
    return {"zmin": lo, "zmax": hi, "colorscale": "Viridis", "colorbar": {}}


def threshold_scale(lo: float, hi: float, t: float) -> Figure:
    """The live page's scale (``monitor.colour_scale``): a sharp break at ``t``, ``t`` labelled on the bar."""
    scale = [list(stop) for stop in colorscale(lo, hi, t)]
    ticks = [v for v in (lo + p * (hi - lo) for p in (0, 0.2, 0.4, 0.6, 0.8, 1)) if abs(v - t) > 0.06 * (hi - lo)]
    tickvals = sorted([*ticks, t])
    ticktext = [f"<b>{as_text(t)} collapse</b>" if v == t else f"{v:.3g}" for v in tickvals]
    return {
        "zmin": lo,
        "zmax": hi,
        "colorscale": scale,
        "colorbar": {"tickvals": tickvals, "ticktext": ticktext, "ticks": "outside"},
    }


def _extent(heatmaps: list[Json]) -> tuple[float, float]:
    values = [v for h in heatmaps for row in h["values"] for v in map(finite, row) if v is not None]
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    return lo, hi


# ---- figures (plotly figure dicts) --------------------------------------------------------------


def step_range(runs: list[RunData]) -> list[float] | None:
    """One step range for every run's heatmaps, half a column wider each side, so columns line up."""
    filled = [r.heatmaps["qkai"]["steps"] for r in runs if r.heatmaps["qkai"]["steps"]]
    if not filled:
        return None
    half = [(s[-1] - s[0]) / (len(s) - 1) / 2 if len(s) > 1 else 0.5 for s in filled]
    return [
        min(s[0] - w for s, w in zip(filled, half, strict=True)),
        max(s[-1] + w for s, w in zip(filled, half, strict=True)),
    ]


def layer_range(runs: list[RunData]) -> list[float]:
    """One layer range for every heatmap (a metric a run did not report is an empty map of the same size)."""
    top = max([0, *(layer for r in runs for h in r.heatmaps.values() for layer in h["layers"])])
    return [-0.5, top + 0.5]


def heatmap_figure(
    data: RunData, metric: str, scale: Figure, axes: tuple[list[float] | None, list[float]], threshold: float
) -> Figure:
    h = data.heatmaps[metric]
    x_range, y_range = axes
    z = [[finite(row[j]) for row in h["values"]] for j in range(len(h["layers"]))]  # (layers, steps)
    trace = {
        "type": "heatmap",
        "x": h["steps"],
        "y": h["layers"],
        "z": z,
        "zmin": scale["zmin"],
        "zmax": scale["zmax"],
        "colorscale": scale["colorscale"],
        "colorbar": {**scale["colorbar"], "thickness": 14, "title": {"text": metric}},
        "hovertemplate": f"step %{{x}}, layer %{{y}}<br>{metric} %{{z:.4g}}<extra></extra>",
    }
    title = f"{_run_title(data)}<br><span style='font-size:12px'>{heatmap_summary(data, metric, threshold)}</span>"
    layout = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.02, "xanchor": "left"},
        "margin": {"t": 62, "r": 8, "b": 44, "l": 52},
        "plot_bgcolor": GAP,
        "xaxis": {"title": {"text": "step"}, "range": x_range},
        "yaxis": {"title": {"text": "layer"}, "range": y_range, "dtick": 1 if y_range[1] < 24 else None},
    }
    if not h["steps"]:
        layout["annotations"] = [_note(f"{metric} not reported by this run")]
    return {"data": [trace] if h["steps"] else [], "layout": layout}


def heatmap_summary(data: RunData, metric: str, threshold: float) -> str:
    h = data.heatmaps[metric]
    if not h["steps"]:
        return f"{html.escape(metric)}: no reports"
    parts = [f"<b>{html.escape(metric)}</b>", f"step {h['steps'][-1]}"]
    if catalogue.on_collapse_scale(metric):
        above = layers_above(data, threshold)
        parts.append(
            f"<span style='color:#b00020'>{len(above)} layer{'s' if len(above) > 1 else ''} above "
            f"{as_text(threshold)}: {', '.join(map(str, above))}</span>"
            if above
            else f"no layer above {as_text(threshold)}"
        )
    if h["downsampled"]:
        parts.append(f"bucket {h['agg']}")
    return " · ".join(parts)


def layers_above(data: RunData, threshold: float) -> list[int]:
    """The layers whose latest QKAI is above the collapse threshold."""
    return sorted(layer for layer, (v, _) in data.latest.items() if v > threshold)


def layer_curves_figure(data: RunData, threshold: float, x_range: list[float] | None) -> Figure:
    """QKAI of each layer over steps; the layers above the threshold at the end drawn heavier."""
    h = data.heatmaps["qkai"]
    above = set(layers_above(data, threshold))
    traces = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": f"layer {layer}",
            "x": h["steps"],
            "y": [finite(row[j]) for row in h["values"]],
            "line": {"color": LAYER_COLORS[layer % len(LAYER_COLORS)], "width": 2.6 if layer in above else 1.2},
            "opacity": 1.0 if layer in above else 0.75,
            "hovertemplate": f"layer {layer}, step %{{x}}: %{{y:.3f}}<extra></extra>",
        }
        for j, layer in enumerate(h["layers"])
    ]
    layout = {
        "title": {
            "text": f"{_run_title(data)}<br><span style='font-size:12px'>qkai per layer over steps</span>",
            "font": {"size": 14},
            "x": 0.02,
            "xanchor": "left",
        },
        "margin": {"t": 62, "r": 8, "b": 44, "l": 52},
        "xaxis": {"title": {"text": "step"}, "range": x_range},
        "yaxis": {"title": {"text": "qkai"}, "range": [0, 1.02]},
        **_threshold_marks(threshold),
    }
    if not traces:
        layout["annotations"] = [_note("qkai not reported by this run")]
    return {"data": traces, "layout": layout}


def latest_figure(runs: list[RunData], threshold: float) -> Figure:
    """Each run's latest QKAI per layer, one line per run, the region above the threshold shaded."""
    traces = []
    for i, data in enumerate(runs):
        layers = sorted(data.latest)
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": html.escape(data.label),  # Plotly draws markup in a name: escaped, it is text
                "x": layers,
                "y": [data.latest[layer][0] for layer in layers],
                "line": {"color": RUN_COLORS[i % len(RUN_COLORS)], "width": 2},
                "hovertemplate": f"layer %{{x}}: %{{y:.3f}}<extra>{html.escape(data.label)}</extra>",
            }
        )
    layout = {
        "title": {"text": "latest qkai per layer", "font": {"size": 14}, "x": 0.02, "xanchor": "left"},
        "margin": {"t": 40, "r": 8, "b": 70, "l": 52},
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "yref": "container", "y": 0, "yanchor": "bottom"},
        "xaxis": {"title": {"text": "layer"}, "dtick": 1, "zeroline": False},
        "yaxis": {"title": {"text": "qkai"}, "range": [0, 1.02]},
        **_threshold_marks(threshold),
    }
    return {"data": traces, "layout": layout}


def loss_figure(runs: list[RunData]) -> Figure:
    """Train loss solid, validation loss dashed with markers, in each run's colour (one legend entry per run)."""
    traces = []
    for i, data in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        hover = f"%{{y:.4f}}<extra>{html.escape(data.label)}</extra>"
        for name, series, style in (("loss", data.loss, {}), ("val_loss", data.val_loss, {"dash": "dash"})):
            if series["steps"]:
                traces.append(
                    {
                        "type": "scatter",
                        "mode": "lines+markers" if style else "lines",
                        "name": html.escape(data.label if name == "loss" else f"{data.label} {name}"),
                        "legendgroup": data.run["id"],
                        "showlegend": name == "loss" or not data.loss["steps"],
                        "x": series["steps"],
                        "y": [finite(v) for v in series["values"]],
                        "line": {"color": color, **style},
                        "marker": {"size": 7, "symbol": "diamond"},
                        "hovertemplate": f"step %{{x}}: {name} {hover}",
                    }
                )
    layout = {
        "title": {"text": "loss (train solid, validation dashed)", "font": {"size": 14}, "x": 0.02, "xanchor": "left"},
        "margin": {"t": 40, "r": 8, "b": 70, "l": 52},
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "yref": "container", "y": 0, "yanchor": "bottom"},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "loss"}},
    }
    if not traces:
        layout["annotations"] = [_note("no loss reported")]
    return {"data": traces, "layout": layout}


def lambdas_figure(data: RunData) -> Figure:
    """The lambdas the collector serves now, one bar per layer (overrides orange), the flag floor dashed."""
    lam = data.lambdas
    values, overrides = lam["lambdas"], lam["overrides"]
    colors = ["#fd8d3c" if str(i) in overrides else "#2171b5" for i in range(len(values))]
    schedule = lam.get("schedule") or {}
    floor = schedule.get("floor", 0) * schedule.get("lambda_0", 0)
    log = bool(values) and all(v > 0 for v in values) and floor > 0
    layout = {
        "title": {
            "text": f"{_run_title(data)}<br><span style='font-size:12px'>lambda per layer, version "
            f"{lam['version']} at step {lam['step']} (orange: override)</span>",
            "font": {"size": 14},
            "x": 0.02,
            "xanchor": "left",
        },
        "margin": {"t": 62, "r": 8, "b": 44, "l": 64},
        "xaxis": {"title": {"text": "layer"}, "dtick": 1},
        "yaxis": {"title": {"text": "lambda"}, "type": "log" if log else "linear", "exponentformat": "e"},
    }
    if floor > 0:
        layout["shapes"] = [
            {
                "type": "line",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": floor,
                "y1": floor,
                "line": {"color": "#b00020", "dash": "dash", "width": 1.2},
            }
        ]
        layout["annotations"] = [
            {
                "xref": "paper",
                "x": 1,
                "y": math.log10(floor) if log else floor,
                "xanchor": "right",
                "yanchor": "bottom",
                "showarrow": False,
                "text": f"flag floor {floor:.2g}",
                "font": {"color": "#b00020", "size": 11},
            }
        ]
    trace = {
        "type": "bar",
        "x": list(range(len(values))),
        "y": values,
        "marker": {"color": colors},
        "hovertemplate": "layer %{x}: lambda %{y:.3g}<extra></extra>",
    }
    return {"data": [trace], "layout": layout}


def _threshold_marks(t: float) -> Figure:
    return {
        "shapes": [
            {
                "type": "rect",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": t,
                "y1": 1.02,
                "fillcolor": "#e31a1c",
                "opacity": 0.07,
                "line": {"width": 0},
            },
            {
                "type": "line",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": t,
                "y1": t,
                "line": {"color": "#b00020", "dash": "dash", "width": 1.5},
            },
        ],
        "annotations": [
            {
                "xref": "paper",
                "x": 0,
                "y": t,
                "xanchor": "left",
                "yanchor": "bottom",
                "showarrow": False,
                "text": f"collapse {as_text(t)}",
                "font": {"color": "#b00020", "size": 11},
            }
        ],
    }


def _note(text: str) -> Figure:
    return {
        "xref": "paper",
        "yref": "paper",
        "x": 0.5,
        "y": 0.5,
        "showarrow": False,
        "text": text,
        "font": {"color": "#666", "size": 13},
    }


def _run_title(data: RunData) -> str:
    status = data.run["status"]
    return (
        f"<b>{html.escape(data.label)}</b> <span style='color:{STATUS_COLORS.get(status, '#666')}'>"
        f"({html.escape(status)})</span>"
    )
