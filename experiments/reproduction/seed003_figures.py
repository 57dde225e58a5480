"""The four figures of seed 003's section of docs/reproduction.md, from its results alone.

Rank collapse in width, the spectral gap of ``A``, the gradient norm against depth, and the project's
GPT at initialisation; :mod:`experiments.reproduction.seed003_section` puts them beside its tables.
"""

from __future__ import annotations

import math
from typing import Any

LABELS = {
    "ln_full": "logit var 1, d fixed",
    "ln_causal": "logit var 1, causal",
    "unit_full": "logit var 1/d², d fixed",
    "prop_full": "logit var 1/T, d = T",
}
"""The width sweep's four series, as the figures and the tables name them."""


def figures(results: dict) -> list[tuple[str, Any]]:
    """``(name, plotly figure)`` pairs, in the order the section shows them."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    w, dp, m = results["width"], results["depth"], results["model"]
    ts = w["T"]
    tk = [str(t) for t in ts]
    res = w["results"]

    def col(key: str, variant: str, name: str) -> list[float]:
        return [res[key][variant][t][name]["mean"] for t in tk]

    # figure 1: covariance stable rank vs T
    fig_w = make_subplots(rows=1, cols=2, subplot_titles=("with the outlier: sr(C) - 1", "outlier removed: sr(C)"))
    colors = {"ln_full": "#1f77b4", "ln_causal": "#9467bd", "unit_full": "#2ca02c", "prop_full": "#d62728"}
    for key in ("ln_full", "ln_causal", "unit_full", "prop_full"):
        style = {"name": LABELS[key], "mode": "lines+markers", "line": {"color": colors[key]}, "legendgroup": key}
        fig_w.add_trace(go.Scatter(x=ts, y=col(key, "with", "cov_srank_excess"), **style), row=1, col=1)
        fig_w.add_trace(go.Scatter(x=ts, y=col(key, "removed", "cov_srank"), showlegend=False, **style), row=1, col=2)
    fig_w.add_trace(
        go.Scatter(x=ts, y=[t / 8 for t in ts], name="T / 8", mode="lines", line={"color": "gray", "dash": "dot"}),
        row=1,
        col=2,
    )
    fig_w.update_xaxes(type="log", title_text="context length T")
    fig_w.update_yaxes(type="log")
    fig_w.update_layout(title="Seed 003: rank collapse in width (one layer, isotropic inputs)", width=1000, height=420)

    # figure 2: sigma1, sigma2, gap
    fig_g = go.Figure()
    for key, dash in (("ln_full", None), ("ln_causal", "dash")):
        for name, color in (("sigma1", "#1f77b4"), ("sigma2", "#ff7f0e"), ("gap", "#2ca02c")):
            fig_g.add_trace(
                go.Scatter(
                    x=ts,
                    y=col(key, "with", name),
                    mode="lines+markers",
                    name=f"{name}(A), {'causal' if 'causal' in key else 'non-causal'}",
                    line={"color": color, "dash": dash},
                )
            )
    fig_g.add_trace(
        go.Scatter(
            x=ts,
            y=[2 * math.sqrt(math.e - 1) / math.sqrt(t) for t in ts],
            mode="lines",
            name="2 sqrt(e - 1) / sqrt(T) (i.i.d. bulk edge)",
            line={"color": "gray", "dash": "dot"},
        )
    )
    fig_g.update_xaxes(type="log", title_text="context length T")
    fig_g.update_layout(title="Seed 003: the spectral gap of A (logit variance 1)", width=800, height=420)

    # figure 3: depth
    fig_d = make_subplots(rows=1, cols=2, subplot_titles=("i.i.d. Markov network", "real attention (logits from X_l)"))
    layers = list(range(1, dp["layers"] + 1))
    styles = {
        ("1", "with"): ("#1f77b4", None),
        ("1", "removed"): ("#1f77b4", "dash"),
        ("bulk", "with"): ("#d62728", None),
        ("bulk", "removed"): ("#d62728", "dash"),
    }
    for c, net in enumerate(("markov", "attention"), start=1):
        for (gain, variant), (color, dash) in styles.items():
            r = dp["runs"][f"{net}_g{gain}_{variant}"]
            y = [None if v is None else v / math.log(10) for v in r["ln_grad2"]]
            g_text = "1" if gain == "1" else f"{dp['bulk_gain']:.1f}"
            name = f"g = {g_text}, {'A - U' if variant == 'removed' else 'A'}"
            fig_d.add_trace(
                go.Scatter(
                    x=layers,
                    y=y,
                    mode="lines+markers",
                    name=name,
                    line={"color": color, "dash": dash},
                    legendgroup=name,
                    showlegend=c == 1,
                ),
                row=1,
                col=c,
            )
    fig_d.update_xaxes(title_text="depth L")
    fig_d.update_yaxes(title_text="log10 ||dloss/dX_0||²")
    fig_d.update_layout(
        title=f"Seed 003: gradient norm against depth (T = {dp['T']}, d = {dp['d']})", width=1000, height=420
    )

    # figure 4: the project's model
    mt = m["T"]
    fig_m = make_subplots(rows=1, cols=2, subplot_titles=("attn_srank", "attn_gap1"))
    for c, metric in enumerate(("attn_srank", "attn_gap1"), start=1):
        for variant, color in (("vanilla", "#1f77b4"), ("outlier_removed", "#d62728")):
            fig_m.add_trace(
                go.Scatter(
                    x=mt,
                    y=[m[variant][str(t)][metric] for t in mt],
                    mode="lines+markers",
                    name=variant,
                    line={"color": color},
                    legendgroup=variant,
                    showlegend=c == 1,
                ),
                row=1,
                col=c,
            )
        fig_m.add_trace(
            go.Scatter(
                x=mt,
                y=[m["causal_uniform"][str(t)][metric] for t in mt],
                mode="lines",
                name="exactly uniform causal A",
                line={"color": "gray", "dash": "dot"},
                legendgroup="u",
                showlegend=c == 1,
            ),
            row=1,
            col=c,
        )
    fig_m.update_xaxes(type="log", title_text="context length T")
    fig_m.update_layout(
        title=f"Seed 003 on the project's GPT at initialisation ({m['recipe']} shape, causal)", width=1000, height=420
    )

    return [("seed003-width", fig_w), ("seed003-gap", fig_g), ("seed003-depth", fig_d), ("seed003-model", fig_m)]
