"""``qkwatch report``: a run's diagnostics as one self-contained HTML file, read from a collector.

The file inlines plotly.js once and embeds its data, so it opens from disk with no network (attach it
to an incident, mail it, keep it after the collector's retention deleted the run). It holds the band
heatmaps (QKAI on the live page's colour scale, which breaks at the collapse threshold; stable rank,
attention entropy, lambda), QKAI per layer over steps, the latest QKAI per layer, the loss, the alerts
(one still firing when its run ended reads "run ended while firing", with the run's last step and its
last values, never "resolved"), the lambdas with their override audit trail, the config, the status,
and the run's tags and notes in its summary. Given a second run (``--vs``) every figure shows both
runs, side by side on the same colour scale and step range.

Only the collector's REST API is read, through :class:`qkwatch.monitor.client.Client`. The figures are
``monitor.report_figures``; this module reads the runs and lays out the page.
"""

from __future__ import annotations

import html
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qkwatch.contract.thresholds import as_text
from qkwatch.monitor.client import Client, CollectorError
from qkwatch.monitor.report_figures import (
    Figure,
    Json,
    RunData,
    colour_scale,
    finite,
    heatmap_figure,
    lambdas_figure,
    latest_figure,
    layer_curves_figure,
    layer_range,
    layers_above,
    loss_figure,
    step_range,
)

logger = logging.getLogger(__name__)

BAND_METRICS = ("qkai", "stable_rank", "attn_entropy", "lambda")
MAX_STEPS = 1000  # heatmap columns per run; more steps are bucketed by max, as on the live page
MAX_POINTS = 2000  # loss points per run
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


class ReportError(Exception):
    """Something the user has to fix: no collector URL, an unknown run, a missing or refused token."""


# ---- reading ------------------------------------------------------------------------------------


def endpoint(url: str | None = None, token: str | None = None) -> tuple[str, str | None]:
    """The collector's URL and token: the arguments, else ``QKWATCH_URL`` and ``QKWATCH_TOKEN``.

    Raises:
        ReportError: no URL either way (a token is optional: an ``--open`` collector needs none).
    """
    url = url or os.environ.get("QKWATCH_URL") or None
    token = token or os.environ.get("QKWATCH_TOKEN") or None
    if not url:
        raise ReportError("no collector URL: pass --url URL or set QKWATCH_URL")
    return url, token


def resolve_run(client: Client, ref: str) -> Json:
    """The run ``ref`` names (a run id, or ``project/name``), as the collector sent it."""
    if "/" in ref:
        project, name = ref.split("/", 1)
        found = client.runs(project=project, name=name, limit=1).data
        if found:
            return found[0].raw
    else:
        try:
            return client.run(ref).raw
        except CollectorError as exc:
            if exc.status != 404:
                raise
    raise ReportError(
        f"no run {ref!r} on the collector (give a run id or project/name; `qkwatch runs list` lists them)"
    )


def fetch_run(client: Client, run: Json) -> RunData:
    rid = run["id"]
    # The collector answers 404 for a metric the run never reported (a vanilla run has no lambda),
    # so ask only for those it has; the others are drawn empty.
    have = client.metrics(rid).metrics
    heatmaps = {
        m: client.heatmap(rid, m, max_steps=MAX_STEPS).raw if m in have else _empty_heatmap(m) for m in BAND_METRICS
    }
    loss, val_loss = (
        client.series(rid, m, max_points=MAX_POINTS).raw if m in have else _empty_series(m)
        for m in ("loss", "val_loss")
    )
    return RunData(
        run=run,
        heatmaps=heatmaps,
        latest=latest_values(client, rid, heatmaps["qkai"]),
        loss=loss,
        val_loss=val_loss,
        alerts=client.alerts(run=rid)["data"],
        lambdas=client.lambdas(rid).raw,
        audit=client.lambdas_audit(rid)["data"],
    )


def _empty_heatmap(metric: str) -> Json:
    return {
        "metric": metric,
        "agg": "max",
        "attempt": None,
        "downsampled": False,
        "steps": [],
        "layers": [],
        "values": [],
    }


def _empty_series(metric: str) -> Json:
    return {
        "metric": metric,
        "layer": -1,
        "head": -1,
        "attempt": None,
        "downsampled": False,
        "steps": [],
        "values": [],
        "min": [],
        "max": [],
    }


def latest_values(client: Client, run_id: str, h: Json) -> dict[int, tuple[float, int]]:
    """Each layer's last finite value; a downsampled heatmap's last bucket is its max, so it is re-read unbucketed."""
    values = _last_values(h)
    if h["downsampled"] and h["steps"]:
        values.update(_last_values(client.heatmap(run_id, h["metric"], start=h["steps"][-1], max_steps=20_000).raw))
    return values


def _last_values(h: Json) -> dict[int, tuple[float, int]]:
    out: dict[int, tuple[float, int]] = {}
    for j, layer in enumerate(h["layers"]):
        for step, row in zip(reversed(h["steps"]), reversed(h["values"]), strict=True):
            v = finite(row[j])
            if v is not None:
                out[layer] = (v, step)
                break
    return out


def explain(exc: CollectorError, url: str, token: str | None) -> str:
    """What to tell the user about an error answer (status 0: the collector was not reached)."""
    if exc.status == 0:
        return exc.message
    if exc.status == 401:
        return (
            f"the collector at {url} refused the token (401: {exc.message})"
            if token
            else f"the collector at {url} wants a read token: pass --token TOKEN or set QKWATCH_TOKEN"
        )
    return f"collector at {url}: {exc}"


def write_report(
    run: str, out: Path, *, vs: str | None = None, url: str | None = None, token: str | None = None
) -> Path:
    """Read ``run`` (and ``vs``) from the collector and write the report to ``out``.

    Args:
        run: a run id or ``project/name``.
        out: the HTML file to write.
        vs: a second run to compare with, or None.
        url: the collector's URL (default: ``QKWATCH_URL``).
        token: a read token (default: ``QKWATCH_TOKEN``).

    Returns:
        ``out``.

    Raises:
        ReportError: no URL, an unknown run, a refused token, an unreachable collector.
    """
    url, token = endpoint(url, token)
    with Client(url, token=token) as client:
        try:
            threshold = client.collapse_threshold()
            runs = [fetch_run(client, resolve_run(client, ref)) for ref in (run, vs) if ref]
        except CollectorError as exc:
            raise ReportError(explain(exc, url, token)) from exc
    out = Path(out)
    out.write_text(render(runs, threshold=threshold, source=url), encoding="utf-8")
    return out


# ---- the page -----------------------------------------------------------------------------------

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
    generated = _time(time.time())
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
        ("status", _status_cell),
        ("tags", _tags_cell),
        ("notes", _notes_cell),
        ("attempt", lambda d: str(d.run["latest_attempt"])),
        ("last step", lambda d: str(d.run["last_step"])),
        ("created", lambda d: _time(d.run["created_at"])),
        ("last report", lambda d: _time(d.run["last_report_at"])),
        (f"layers above {as_text(threshold)} (latest qkai)", lambda d: _above_cell(d, threshold)),
        ("highest latest qkai", lambda d: _highest_cell(d)),
        ("alerts", _alerts_cell),
        ("final train loss", lambda d: _last(d.loss)),
        ("final validation loss", lambda d: _last(d.val_loss)),
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
        f"{_grid(figures, 2)}</section>\n"
    )


def heatmaps_section(runs: list[RunData], threshold: float) -> str:
    """A metric per row with the runs side by side (one run: two metrics per row), one scale per metric."""
    axes = step_range(runs), layer_range(runs)
    cells = []
    for metric in BAND_METRICS:
        scale = colour_scale(metric, [r.heatmaps[metric] for r in runs], threshold)
        cells += [
            plot(heatmap_figure(r, metric, scale, axes, threshold), f"fig-heatmap-{metric}-{i}")
            for i, r in enumerate(runs)
        ]
    return f'<section id="heatmaps"><h2>Band heatmaps</h2><div class="grid">{"".join(cells)}</div></section>\n'


def curves_section(runs: list[RunData], threshold: float) -> str:
    x_range = step_range(runs)
    cells = "".join(plot(layer_curves_figure(r, threshold, x_range), f"fig-layers-{i}") for i, r in enumerate(runs))
    return f'<section id="layers"><h2>QKAI per layer over steps</h2>{_grid(cells, len(runs))}</section>\n'


STATE_TEXT = {"ended": "run ended while firing"}
"""An alert's state as the report shows it: an alert still firing when its run ended is never "resolved"."""
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
                    f'<span class="state">{html.escape(_state_text(a["state"]))}</span>',
                    html.escape(a["severity"]),
                    f"<b>{html.escape(a['rule'])}</b>",
                    _layers(a["layers"]),
                    _num(a["onset_step"]),
                    html.escape(_end(a)),
                    html.escape(_end_values(a)),
                    _time(a["starts_at"]),
                    html.escape(a["summary"]),
                ],
            )
            for a in _ordered(d.alerts)
        ]
        parts.append(
            f"<h3>{html.escape(d.label)}</h3>"
            + _table(
                ["state", "severity", "rule", "layers", "onset step", "end", "last values", "since", "summary"],
                rows,
                empty="no alerts",
            )
        )
    return f'<section id="alerts"><h2>Alerts</h2>{"".join(parts)}</section>\n'


def _state_text(state: str) -> str:
    return STATE_TEXT.get(state, state)


def _ordered(alerts: list[Json]) -> list[Json]:
    return sorted(alerts, key=lambda a: STATE_ORDER.get(a["state"], 3))  # stable: newest first within a state


def _end(a: Json) -> str:
    """How the alert stopped: "resolved at step 30", "run finished at step 800", or "" while it fires."""
    if a["state"] == "resolved":
        return f"resolved at step {a['resolved_step']}"
    if a["state"] == "ended":
        at = "" if a.get("ended_step") is None else f" at step {a['ended_step']}"
        return f"run {a.get('run_end') or 'ended'}{at}"
    return ""


def _end_values(a: Json) -> str:
    """An ended alert's metric on each of its layers at the run's end: "qkai 3: 0.931, 4: 0.95"."""
    last = a.get("last_values")
    if not last:
        return ""
    values = ", ".join(f"{layer}: {_value(v)}" for layer, v in zip(a["layers"], last, strict=False))
    return f"{a['metric']} {values}"


def _ended_detail(a: Json) -> str:
    """ "3-5; last qkai 3: 0.93, 4: 0.95, 5: 0.91": an ended alert's layers and last values."""
    values = _end_values(a)
    return _layers(a["layers"]) + (f"; last {values}" if values else "")


def _value(v: float | str | None) -> str:
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v:.4g}"


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
                    _num(v),
                    _num(lam["overrides"].get(str(layer))),
                    _num(h[layer] if layer < len(h) else None),
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
                    _num(a["step"]),
                    str(a["layer"]),
                    _num(a["old"]),
                    _num(a["new"]),
                    html.escape(a["who"]),
                    _time(a["at"]),
                ],
            )
            for a in d.audit
        ]
        parts.append(
            f"<div><h3>{html.escape(d.label)}</h3>{plot(lambdas_figure(d), f'fig-lambdas-{i}', 320)}"
            f"<div class='meta'>what the collector serves (source {html.escape(str(lam.get('source')))}; a run "
            f"applies them only with RAA on); schedule <code>{html.escape(json.dumps(schedule))}</code></div>"
            + _table(
                ["layer", "lambda", "override", "running entropy H", "above the flag floor"],
                rows,
                empty="no layers yet",
            )
            + "<h3>override audit trail</h3>"
            + _table(["version", "step", "layer", "old", "new", "who", "at"], audit, empty="no overrides")
            + "</div>"
        )
    return f'<section id="lambdas"><h2>Lambdas</h2>{_grid("".join(parts), len(runs))}</section>\n'


def config_section(runs: list[RunData]) -> str:
    parts = "".join(
        f"<div><h3>{html.escape(d.label)}</h3><pre>{html.escape(json.dumps(d.run['config'], indent=2))}</pre></div>"
        for d in runs
    )
    return f'<section id="config"><h2>Config</h2>{_grid(parts, len(runs))}</section>\n'


# ---- cells --------------------------------------------------------------------------------------


def _grid(cells: str, columns: int) -> str:
    return f'<div class="grid" style="--cols:{columns}">{cells}</div>'


def _table(headers: list[str], rows: list[tuple[str, list[str]]], empty: str) -> str:
    if not rows:
        return f'<p class="none">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(f"<tr {attrs}>{''.join(f'<td>{c}</td>' for c in cells)}</tr>" for attrs, cells in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _status_cell(d: RunData) -> str:
    status = d.run["status"]
    reason = d.run.get("status_reason")
    return f'<span class="status-{html.escape(status)}">{html.escape(status)}</span>' + (
        f" ({html.escape(reason)})" if reason else ""
    )


def _tags_cell(d: RunData) -> str:
    tags = d.run.get("tags") or []
    return " ".join(f'<span class="tag">{html.escape(t)}</span>' for t in tags) or '<span class="none">none</span>'


def _notes_cell(d: RunData) -> str:
    """The notes as the user wrote them (line breaks kept; Markdown shown as its text)."""
    notes = d.run.get("notes")
    return f'<div class="notes">{html.escape(notes)}</div>' if notes else '<span class="none">none</span>'


def _above_cell(d: RunData, threshold: float) -> str:
    above = layers_above(d, threshold)
    return f'<span class="bad">{_layers(above)}</span>' if above else "none"


def _highest_cell(d: RunData) -> str:
    if not d.latest:
        return "-"
    layer, (value, step) = max(d.latest.items(), key=lambda kv: kv[1][0])
    return f"{value:.3f} (layer {layer}, step {step})"


def _alerts_cell(d: RunData) -> str:
    """Firing alerts in red; then those still firing when the run ended, with where it ended and their
    last values (never as resolved); then the resolved ones with the step they resolved at."""
    if not d.alerts:
        return "none"
    firing = [a for a in d.alerts if a["state"] == "firing"]
    ended = [a for a in d.alerts if a["state"] == "ended"]
    done = [a for a in d.alerts if a["state"] not in ("firing", "ended")]
    parts = []
    if firing:
        parts.append(
            '<span class="bad">firing: '
            + ", ".join(f"{html.escape(a['rule'])} ({_layers(a['layers'])})" for a in firing)
            + "</span>"
        )
    if ended:
        ends = ", ".join(dict.fromkeys(_end(a) for a in ended))  # one run: one end, but a resume may make two
        parts.append(
            f'<span class="ended-text">run ended while firing ({html.escape(ends)}): '
            + ", ".join(f"{html.escape(a['rule'])} ({html.escape(_ended_detail(a))})" for a in ended)
            + "</span>"
        )
    if done:
        parts.append(
            "resolved: "
            + ", ".join(
                f"{html.escape(a['rule'])} ({_layers(a['layers'])}, step {a.get('resolved_step')})" for a in done
            )
        )
    return "; ".join(parts)


def _last(series: Json) -> str:
    for step, v in zip(reversed(series["steps"]), reversed(series["values"]), strict=True):
        if finite(v) is not None:
            return f"{finite(v):.4f} (step {step})"
    return "-"


def _layers(layers: list[int]) -> str:
    """ "3-5" for three or more adjacent layers, else "1, 4"."""
    s = sorted(layers)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ", ".join(map(str, s))


def _num(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        x = finite(v)
        return f"{x:.4g}" if x is not None else str(v)
    return html.escape(str(v))


def _time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"
