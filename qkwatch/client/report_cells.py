"""The cells of the tables of ``qkwatch report``: a run's facts, an alert's state, end and last values,
and a value, a layer list or a time as the page shows them. HTML-escaped text in, HTML out.
"""

from __future__ import annotations

import html
import time
from typing import Any

from qkwatch.client.report_figures import Json, RunData, finite, layers_above, visible
from qkwatch.contract.api import ALERT_STATE_TEXT


def grid(cells: str, columns: int) -> str:
    return f'<div class="grid" style="--cols:{columns}">{cells}</div>'


def table(headers: list[str], rows: list[tuple[str, list[str]]], empty: str) -> str:
    if not rows:
        return f'<p class="none">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(f"<tr {attrs}>{''.join(f'<td>{c}</td>' for c in cells)}</tr>" for attrs, cells in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def status_cell(d: RunData) -> str:
    status = d.run["status"]
    reason = d.run.get("status_reason")
    return f'<span class="status-{html.escape(status)}">{html.escape(status)}</span>' + (
        f" ({html.escape(reason)})" if reason else ""
    )


def tags_cell(d: RunData) -> str:
    tags = d.run.get("tags") or []
    return " ".join(f'<span class="tag">{html.escape(t)}</span>' for t in tags) or '<span class="none">none</span>'


def notes_cell(d: RunData) -> str:
    """The notes as the user wrote them (line breaks kept; Markdown shown as its text)."""
    notes = d.run.get("notes")
    return f'<div class="notes">{html.escape(visible(notes))}</div>' if notes else '<span class="none">none</span>'


def above_cell(d: RunData, threshold: float) -> str:
    above = layers_above(d, threshold)
    return f'<span class="bad">{layers_text(above)}</span>' if above else "none"


def highest_cell(d: RunData) -> str:
    if not d.latest:
        return "-"
    layer, (value, step) = max(d.latest.items(), key=lambda kv: kv[1][0])
    return f"{value:.3f} (layer {layer}, step {step})"


def alerts_cell(d: RunData) -> str:
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
            + ", ".join(f"{html.escape(a['rule'])} ({layers_text(a['layers'])})" for a in firing)
            + "</span>"
        )
    if ended:
        ends = ", ".join(dict.fromkeys(end_text(a) for a in ended))  # one run: one end, but a resume may make two
        parts.append(
            f'<span class="ended-text">run ended while firing ({html.escape(ends)}): '
            + ", ".join(f"{html.escape(a['rule'])} ({html.escape(_ended_detail(a))})" for a in ended)
            + "</span>"
        )
    if done:
        parts.append(
            "resolved: "
            + ", ".join(
                f"{html.escape(a['rule'])} ({layers_text(a['layers'])}, step {a.get('resolved_step')})" for a in done
            )
        )
    return "; ".join(parts)


def last_cell(series: Json) -> str:
    for step, v in zip(reversed(series["steps"]), reversed(series["values"]), strict=True):
        if finite(v) is not None:
            return f"{finite(v):.4f} (step {step})"
    return "-"


def layers_text(layers: list[int]) -> str:
    """ "3-5" for three or more adjacent layers, else "1, 4"."""
    s = sorted(layers)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ", ".join(map(str, s))


def num_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        x = finite(v)
        return f"{x:.4g}" if x is not None else str(v)
    return html.escape(str(v))


def time_text(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"


def state_text(state: str) -> str:
    """An alert's state as the report shows it: an alert still firing when its run ended is never "resolved"."""
    return ALERT_STATE_TEXT.get(state, state)


def end_text(a: Json) -> str:
    """How the alert stopped: "resolved at step 30", "run finished at step 800", or "" while it fires."""
    if a["state"] == "resolved":
        return f"resolved at step {a['resolved_step']}"
    if a["state"] == "ended":
        at = "" if a.get("ended_step") is None else f" at step {a['ended_step']}"
        return f"run {a.get('run_end') or 'ended'}{at}"
    return ""


def end_values(a: Json) -> str:
    """An ended alert's metric on each of its layers at the run's end: "qkai 3: 0.931, 4: 0.95"."""
    last = a.get("last_values")
    if not last:
        return ""
    values = ", ".join(f"{layer}: {_value(v)}" for layer, v in zip(a["layers"], last, strict=False))
    return f"{a['metric']} {values}"


def _ended_detail(a: Json) -> str:
    """ "3-5; last qkai 3: 0.93, 4: 0.95, 5: 0.91": an ended alert's layers and last values."""
    values = end_values(a)
    return layers_text(a["layers"]) + (f"; last {values}" if values else "")


def _value(v: float | str | None) -> str:
    if v is None:
        return "-"
    return v if isinstance(v, str) else f"{v:.4g}"
