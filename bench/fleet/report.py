"""The fleet's results for people: markdown tables, the goals of issue 33, and the plot against the ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def plot(sessions: list[dict[str, Any]], path: Path, note: str = "") -> None:
    """p99 latency and points/s against the number of ranks (plotly, PNG through kaleido)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ranks = [s["config"]["ranks"] for s in sessions]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p99 latency at the agents", "points per second"))
    for key, label, dash in (("post", "POST of a batch", "solid"), ("delivery", "report to stored", "dot")):
        ys = [s["latency"][key]["p99_ms"] for s in sessions]
        fig.add_trace(go.Scatter(x=ranks, y=ys, name=f"p99 {label}", mode="lines+markers", line={"dash": dash}), 1, 1)
    for key, label, dash in (
        ("stored_points_per_s", "stored", "solid"),
        ("sent_points_per_s", "sent by the agents", "dot"),
        ("offered_points_per_s", "offered (the nominal cadence)", "dash"),
    ):
        ys = [s["rates"][key] for s in sessions]
        fig.add_trace(go.Scatter(x=ranks, y=ys, name=label, mode="lines+markers", line={"dash": dash}), 1, 2)
    for col in (1, 2):
        fig.update_xaxes(title_text="simulated ranks", type="log", tickvals=ranks, row=1, col=col)
    fig.update_yaxes(title_text="ms", type="log", row=1, col=1)
    fig.update_yaxes(title_text="points/s", row=1, col=2)
    c = sessions[0]["config"]
    fig.update_layout(
        title=f"qkwatch fleet: {c['replicas']} replicas x {c['workers']} workers, HAProxy, one PostgreSQL "
        f"({c['duration']:g} s of load per point, kill -9 of one replica midway){note and '<br>' + note}",
        width=1100,
        height=480,
        margin={"t": 110},
    )
    os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
    fig.write_image(path, scale=1)


def table(sessions: list[dict[str, Any]]) -> str:
    """The results as markdown tables: load and correctness, then the kill and the CPU time."""
    lines = [
        "| ranks | runs | POST p50 / p99 / max ms | delivery p50 / p99 / max ms | pts/s offered / sent / stored "
        "| pts per POST | sent = stored | lost | dup | alerts (expected) | lambdas equal |",
        "|---:|---:|---|---|---|---:|---|---:|---:|---|---|",
    ]
    for s in sessions:
        p, d = s["latency"]["post"], s["latency"]["delivery"]
        pts, al, la, r = s["points"], s["alerts"], s["lambdas"], s["rates"]
        equal = not (
            la["runs_whose_replicas_differ"]
            or la["versions_with_two_answers"]
            or la["runs_not_the_ema_of_what_was_sent"]
        )
        lines.append(
            f"| {s['config']['ranks']} | {s['runs']} | {_ms(p)} | {_ms(d)} | {r['offered_points_per_s']:,.0f} / "
            f"{r['sent_points_per_s']:,.0f} / {r['stored_points_per_s']:,.0f} | {r['points_per_post']:,.0f} "
            f"| {pts['sent']:,} = {pts['stored']:,} | {pts['lost']} | {pts['duplicated']} "
            f"| {al['raised']} ({al['expected']}) | {'yes' if equal else 'NO'} |"
        )
    lines += [
        "",
        "| ranks | killed at s | HAProxy saw it down at s | restarted, UP in HAProxy at s | requests to it after "
        "| failed calls (retried) | replayed pts | drain s | agents' lag s | collector CPU s | PG CPU s "
        "| pts per collector CPU-s | pts per PG CPU-s |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sessions:
        k, c, r = s["kill"], s["cpu"], s["rates"]
        failed = ", ".join(f"{n} {what}" for what, n in sorted(s["posts"]["failed"].items())) or "0"
        lines.append(
            f"| {s['config']['ranks']} | {_s(k.get('killed_at'))} | {_s(k.get('seen_down_at'))} "
            f"| {_s(k.get('seen_up_at'))} | {k['requests_served_after_restart']} | {failed} "
            f"| {s['posts']['replayed_points']:,} | {r['drain_s']:.1f} | {r['producer_lag_max_s']:.1f} "
            f"| {c['collector']:.0f} | {c['database']:.0f} | {c['points_per_collector_cpu_s']:,.0f} "
            f"| {c['points_per_database_cpu_s']:,.0f} |"
        )
    return "\n".join(lines)


P99_GOAL_MS = 250.0
"""Issue 33's goal: POST p99 under this at 16 ranks."""
RANKS_PLANNED = 10_000


def goals(sessions: list[dict[str, Any]]) -> str:
    """Each session's POST p99 beside the goal, its points per collector CPU-second and, from that
    figure, the collector cores that 10,000 ranks at this cadence would need."""
    lines = []
    for s in sessions:
        ranks, p99 = s["config"]["ranks"], s["latency"]["post"]["p99_ms"]
        per_cpu = s["cpu"]["points_per_collector_cpu_s"]
        per_rank = s["rates"]["offered_points_per_s"] / ranks
        verdict = "-" if p99 is None else ("met" if p99 < P99_GOAL_MS else "not met")
        cores = RANKS_PLANNED * per_rank / per_cpu if per_cpu else float("nan")
        lines.append(
            f"{ranks} ranks: POST p99 {p99:,.0f} ms (goal < {P99_GOAL_MS:.0f} ms at 16 ranks: {verdict}); "
            f"{per_cpu:,.0f} points per collector CPU-second; {RANKS_PLANNED:,} ranks at {per_rank:,.0f} points/s "
            f"each = {RANKS_PLANNED * per_rank:,.0f} points/s = {cores:,.0f} collector cores at that rate"
        )
    return "\n".join(lines)


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def _ms(p: dict[str, Any]) -> str:
    return " / ".join("-" if p[k] is None else f"{p[k]:,.0f}" for k in ("p50_ms", "p99_ms", "max_ms"))
