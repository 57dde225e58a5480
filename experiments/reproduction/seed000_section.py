"""Seed 000's section of docs/reproduction.md: its tables and figures, and the paper's claims against ours.

Every number comes from ``experiments/results/seed000.json`` through
:mod:`experiments.reproduction.seed000_analysis`; every verdict is computed from the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

from experiments.common import fmt, md_table
from experiments.reproduction.seed000_analysis import balance, by_variant, last_val_loss, summary, variant_order

PAPER_FLAGGED = 7 / 24
"""Seed 000: the schedule "activated the full penalty on only about 7 of 24 layers for most of training"."""


def section(results: dict) -> tuple[str, list[tuple[str, Any]]]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = summary(results)
    n_seeds = len(results["seeds"])
    variants = sorted(results["variants"], key=variant_order)
    table = md_table(
        [
            "variant",
            f"band QKAI step {results['onset']} → last (peak)",
            "outside, last",
            f"band srank step {results['onset']} → lowest (step) → last",
            "band entropy last",
            "band QK^T erank",
            "val loss",
            "passkey-1 @128 (exact / digits)",
            "passkey-1 @256",
            "passkey-5 @256",
            "ppl @128",
            "ppl @256",
            "layers flagged (all / 2nd half)",
        ],
        [
            [
                v,
                f"{fmt(r['qkai_onset'], '.2f')} → {fmt(r['qkai_final'], '.2f')} ({fmt(r['qkai_peak'], '.2f')})",
                fmt(r["qkai_outside_final"], ".2f"),
                f"{fmt(r['srank_onset'], '.2f')} → {fmt(r['srank_low'], '.2f')} ({fmt(r['srank_low_step'], '.0f')})"
                f" → {fmt(r['srank_final'], '.2f')}",
                fmt(r["entropy_final"], ".2f"),
                fmt(r["qk_erank_final"], ".2f"),
                fmt(r["val_loss"], ".3f"),
                _pk(r, 1, 128),
                _pk(r, 1, 256),
                _pk(r, 5, 256),
                fmt(r["ppl_128"], ".2f"),
                fmt(r["ppl_256"], ".2f"),
                _flagged(r),
            ]
            for v, r in rows.items()
        ],
    )

    figs = []
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("band QKAI (layers 3-5)", "band stable rank of W_Q W_K^T", "band normalised entropy"),
    )
    palette = ["#444", "#1f77b4", "#9467bd", "#17becf", "#d62728", "#2ca02c", "#ff7f0e"]
    by = by_variant(results)
    for i, variant in enumerate(variants):
        for col, metric in enumerate(("qkai", "stable_rank", "attn_entropy"), start=1):
            for j, r in enumerate(by[variant]):
                if not r.get(metric):
                    continue
                fig.add_trace(
                    go.Scatter(
                        x=r[metric]["steps"],
                        y=r[metric]["band"],
                        mode="lines",
                        line={"color": palette[i % len(palette)], "width": 2 if j == 0 else 1},
                        name=variant,
                        legendgroup=variant,
                        showlegend=(col == 1 and j == 0),
                    ),
                    row=1,
                    col=col,
                )
    fig.add_hline(y=0.70, line_dash="dash", line_color="red", row=1, col=1)
    fig.update_layout(width=1300, height=420, margin={"t": 40, "b": 40}, template="plotly_white")
    figs.append(("seed000-band", fig))

    evals = ["passkey1_digits_128", "passkey1_digits_256", "passkey5_digits_256"]
    fig2 = go.Figure([go.Bar(name=e, x=variants, y=[rows[v][e] for v in variants]) for e in evals])
    fig2.add_hline(y=0.1, line_dash="dot", annotation_text="a guessed digit")
    fig2.update_layout(
        barmode="group",
        width=900,
        height=380,
        template="plotly_white",
        yaxis_title="key digits predicted",
        title="passkey retrieval, digit accuracy (1 and 5 needles; trained at 128 tokens)",
    )
    figs.append(("seed000-passkey", fig2))

    v, raa = rows["vanilla"], rows["raa"]
    bal = balance(results)
    held = bal["measured"]
    # the short-context cost, seed by seed: (vanilla, RAA) validation loss of each seed
    pairs = [(last_val_loss(a), last_val_loss(b)) for a, b in zip(by["vanilla"], by["raa"], strict=True)]
    worse = sum(b > a for a, b in pairs)
    cost_verdict = _verdict(worse == 0) + (
        f": RAA's validation loss is higher in {'every' if worse == len(pairs) else f'{worse} of {len(pairs)}'} seed"
        + ("" if worse == len(pairs) else "s")
        if worse
        else ""
    )
    # the flagged share: the whole run is what "for most of training" measures
    flag_ok = abs(raa["flagged"] - PAPER_FLAGGED) <= 0.10
    band = len(results["band"])
    all_flagged = [
        max((s for s, f in _series(r["raa_flagged_fraction"]) if f >= 1.0), default=None)
        for r in by["raa"]
        if "raa_flagged_fraction" in r
    ]
    all_flagged = [s for s in all_flagged if s is not None]
    flag_verdict = _verdict(flag_ok) + (
        ""
        if flag_ok
        else f": {raa['flagged']:.0%} over the run against {PAPER_FLAGGED:.0%}"
        + (
            f"; every layer is flagged until step {_span(all_flagged)}, while attention is near uniform"
            if all_flagged
            else ""
        )
        + f"; the 2nd half's {raa['flagged_late']:.0%} is about the induced band, {band} of 8 layers ({band / 8:.0%}),"
        " which the recipe sets"
    )
    text = f"""## Seed 000: the collapse band, RAA, its ablations and the peers (`collapse_cpu`)

**Command:** `python -m experiments.seed000 --seeds {",".join(map(str, results["seeds"]))}` then
`python -m experiments.report`. {len(variants)} variants x {n_seeds} seeds of `collapse_cpu` (8 layers,
d_model 128, 4 heads of 32, 800 steps of 8 x 128 tokens, byte-level offline corpus), each streamed
into one collector and evaluated with `qkwatch eval` (passkey: {results["eval_samples"]} queries per
length and needle count). Every number below is read back from that collector; a table cell is
the mean over the seeds.

**Scale and the induced band.** Seed 000 trains 1.3B and 6.7B models on 60B tokens and finds the band
arising by itself; here the band (layers 3-5) is *induced* from step {results["onset"]} by the
`qk_collapse` intervention (an explicit alignment pressure on W_Q/W_K plus a contraction of W_K,
`qkwatch/trainer/run/interventions.py`), which every variant receives. So this experiment tests whether each
method *resists* a collapse pressure of seed 000's phenotype, not whether it prevents a collapse
that training produces by itself.

{table}

![band trajectories](reproduction/seed000-band.png)

![passkey](reproduction/seed000-passkey.png)

`qkwatch report` of the vanilla and the full-RAA run, side by side:
[reproduction/seed000-report.html](reproduction/seed000-report.html).

| claim (seed 000) | paper | here | carried over? |
|---|---|---|---|
| band QKAI rises past 0.70 in vanilla training | 0.31 → 0.78 (1.3B) | {fmt(v["qkai_onset"], ".2f")} → {fmt(v["qkai_final"], ".2f")} (induced) | by construction: the band is induced |
| RAA holds the band's QKAI | 0.42-0.49 | {fmt(raa["qkai_final"], ".2f")} (peak {fmt(raa["qkai_peak"], ".2f")}); {_span([fmt(x, ".3f") for x in held])} from step {bal["full_from"]}, where the two penalties' balance predicts {fmt(bal["predicted"], ".3f")} | {_verdict(raa["qkai_final"] <= 0.55)}, at the balance point of the recipe's weights (see below){", a little above the paper's range" if 0.49 < raa["qkai_final"] <= 0.55 else ""} |
| stable rank of W_Q W_K^T higher under RAA (layer 15) | 22.3 → 41.6 of 128 | band, last: {fmt(v["srank_final"], ".2f")} → {fmt(raa["srank_final"], ".2f")} of 32; lowest on the way: vanilla {fmt(v["srank_low"], ".2f")} (step {fmt(v["srank_low_step"], ".0f")}), RAA {fmt(raa["srank_low"], ".2f")} (step {fmt(raa["srank_low_step"], ".0f")}) | {_verdict(raa["srank_final"] > v["srank_final"])} at the end; under RAA too it first falls from {fmt(raa["srank_onset"], ".2f")} at step {results["onset"]} to as low as vanilla's |
| mid-layer entropy lower under RAA | 0.94 → 0.71-0.76 | {fmt(v["entropy_final"], ".2f")} → {fmt(raa["entropy_final"], ".2f")} | {_verdict(raa["entropy_final"] < v["entropy_final"] - 0.05)} |
| schedule activates about 7 of 24 layers for most of training | {PAPER_FLAGGED:.0%} | {_flagged(raa)} of 8 (all / 2nd half) | {flag_verdict} |
| passkey gain of RAA (32k, 1 needle) | 61.2 → 84.7 % | exact {fmt(v["passkey1_acc_256"], ".2f")} → {fmt(raa["passkey1_acc_256"], ".2f")}, digits {fmt(v["passkey1_digits_256"], ".2f")} → {fmt(raa["passkey1_digits_256"], ".2f")} at 256 | {_verdict(raa["passkey1_digits_256"] > v["passkey1_digits_256"] + 0.05)} |
| five-needle passkey | 38 → 66 % | exact {fmt(v["passkey5_acc_256"], ".2f")} → {fmt(raa["passkey5_acc_256"], ".2f")}, digits {fmt(v["passkey5_digits_256"], ".2f")} → {fmt(raa["passkey5_digits_256"], ".2f")} | {_verdict(raa["passkey5_digits_256"] > v["passkey5_digits_256"] + 0.05)} |
| no short-context cost | ppl 11.87 → 11.83 at 2k | val loss {fmt(v["val_loss"], ".3f")} → {fmt(raa["val_loss"], ".3f")} (by seed: {", ".join(f"{fmt(a, '.3f')} → {fmt(b, '.3f')}" for a, b in pairs)}); ppl {fmt(v["ppl_128"], ".2f")} → {fmt(raa["ppl_128"], ".2f")} at 128 ({raa["ppl_128"] / v["ppl_128"] - 1:+.1%}) | {cost_verdict} |
| QK-norm, sigma-Reparam fix scale, not orientation | 71.4 %, 68.9 % passkey (RAA 84.7 %) | band QKAI {fmt(rows["qk_norm"]["qkai_final"], ".2f")}, {fmt(rows["sigma_reparam"]["qkai_final"], ".2f")} (RAA {fmt(raa["qkai_final"], ".2f")}) | {_verdict(min(rows["qk_norm"]["qkai_final"], rows["sigma_reparam"]["qkai_final"]) > 0.7)}, see below |

**What RAA's hold of the band measures.** The induced pressure is PAR's mirror image: per band head,
with `S = sum_i c_i^2` (r times QKAI), PAR adds `lambda ReLU(S - tau)^2` with `tau = {bal["tau_factor"]} r`
and `qk_collapse` adds `mu ReLU(target ramp r - S)^2`. Between the two thresholds both act, and the
derivative of their sum, `2 lambda (S - tau) - 2 mu (target ramp r - S)`, vanishes at
`S / r = (lambda {bal["tau_factor"]} + mu target ramp) / (lambda + mu)`. With the recipe's
`mu = {bal["mu"]:g}`, `lambda_0 = {bal["lambda_0"]:g}` and `target = {bal["target"]:g}` at full ramp (from step
{bal["full_from"]}), and the band's lambda at `sigmoid((H - {bal["h_star"]:g}) / {bal["beta"]:g}) = {bal["share"]:.3f}` of
`lambda_0` for its measured entropy H = {bal["entropy"]:.2f}, that point is {fmt(bal["predicted"], ".4f")}; the RAA
runs' band QKAI averages {", ".join(f"{fmt(x, '.4f')} (seed {seed})" for x, seed in zip(held, bal["seeds"], strict=True))}
over the reports from step {bal["full_from"]} on. The unscheduled ablations put `lambda_0` itself on the band,
for which the point is {fmt(bal["predicted_fixed"], ".4f")}; they hold
{"; ".join(f"{v} {', '.join(fmt(x, '.4f') for x in xs)}" for v, xs in bal["measured_fixed"].items())}
(seeds {" and ".join(str(seed) for seed in bal["seeds"])}). So the level at which RAA holds this band is set by the recipe's weights: it
shows that the pipeline (metrics, collector, schedule, PAR) works end to end, not that RAA, or the
alerts, handle trouble that nobody designed.

**Entropy and retrieval.** RAA holds the band's subspaces apart (QKAI {fmt(raa["qkai_final"], ".2f")}
against {fmt(v["qkai_final"], ".2f")}) and its final stable rank above vanilla's (after the same dip, to
{fmt(raa["srank_low"], ".2f")} at step {fmt(raa["srank_low_step"], ".0f")}), but the band's attention
still ends uniform (normalised entropy {fmt(raa["entropy_final"], ".2f")}): the induced pressure also
contracts the band's keys toward zero every 5 steps, which drives the logits to 0 whatever the
subspaces' orientation, and nothing in RAA opposes a shrinking key norm. In seed 000 the collapse
*is* the alignment, so holding the subspaces apart lowers the entropy; here the two are decoupled by
construction, which is a limit of the induced band, not a finding about RAA. No variant learns
passkey retrieval in 800 steps at this size: the exact accuracy is 0 everywhere and the digit
accuracy sits at or below the 0.1 of a guessed digit, so this scale cannot test seed 000's retrieval
claims (a negative result about the scale, not about RAA).

**The peers.** QK-norm and sigma-Reparam leave the band's subspaces free to align (band QKAI
{fmt(rows["qk_norm"]["qkai_final"], ".2f")} and {fmt(rows["sigma_reparam"]["qkai_final"], ".2f")}, both
alerting as vanilla does), as seed 000 argues of scale-based fixes; but they keep the band's attention
well below uniform (entropy {fmt(rows["qk_norm"]["entropy_final"], ".2f")} and
{fmt(rows["sigma_reparam"]["entropy_final"], ".2f")} against vanilla's {fmt(v["entropy_final"], ".2f")}),
presumably because normalising the queries and keys (or the projections by their spectral norm)
undoes much of the key contraction that flattens the logits (we did not measure this separately). QK-norm also has the best perplexity ({fmt(rows["qk_norm"]["ppl_128"], ".2f")}
at 128 against {fmt(v["ppl_128"], ".2f")}); sigma-Reparam the worst ({fmt(rows["sigma_reparam"]["ppl_128"], ".2f")}).
On the geometry seed 000 measures, RAA is the only method that holds the band; on what attention
does with it, the scale-based peers do better here.

**The rotation alone.** A rotation R inside a head, `W_K R^T`, leaves the key column space, hence
QKAI and PAR, unchanged (`tests/trainer/test_trainer_raa.py` holds this), so seed 000's picture of the
rotation turning keys away from the query subspace cannot act through the subspace. What it can
change is the bilinear form itself: the band's stable rank of `W_Q R W_K^T` ends at
{fmt(rows["rotation"]["srank_final"], ".2f")} with the rotation alone against
{fmt(v["srank_final"], ".2f")} in vanilla, its entropy at {fmt(rows["rotation"]["entropy_final"], ".2f")}
against {fmt(v["entropy_final"], ".2f")}, passkey-1 digit accuracy at 256
{fmt(rows["rotation"]["passkey1_digits_256"], ".2f")} against {fmt(v["passkey1_digits_256"], ".2f")}.

**Step-time overhead.** Timing concurrent runs on a shared 2-core machine says little; RAA's overhead
is measured A/B, interleaved, in `bench/raa_overhead.py` on this recipe (bench/RESULTS.md): with the
schedule +3.8 % to +4.3 %, on every layer +8.5 % to +9.4 % (seed 000: about 3 % and 9 %).
"""
    return text, figs


def _pk(r: dict, needles: int, length: int) -> str:
    return f"{fmt(r[f'passkey{needles}_acc_{length}'], '.2f')} / {fmt(r[f'passkey{needles}_digits_{length}'], '.2f')}"


def _flagged(r: dict) -> str:
    if not math.isfinite(r["flagged"]):
        return "-"
    return f"{r['flagged']:.0%} / {r['flagged_late']:.0%}"


def _series(m: dict) -> list[tuple[int, float]]:
    return list(zip(m["steps"], m["values"], strict=True))


def _span(values: list) -> str:
    """``a`` or ``a-b``: the range of a few values (formatted strings sort as their numbers here)."""
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _verdict(ok: bool) -> str:
    return "yes" if ok else "no"
