"""Seed 003's section of docs/reproduction.md: its tables, what they show, and whether the paper's claims carried over.

Every number comes from ``experiments/results/seed003.json``; the figures are
:func:`experiments.reproduction.seed003_figures.figures`.
"""

from __future__ import annotations

import math
from typing import Any

from experiments.common import md_table
from experiments.reproduction.seed003_figures import LABELS, figures


def fmt_na(x: float | None, spec: str = ".3g") -> str:
    """``x`` formatted, or ``n/a`` where it was not measured."""
    return "n/a" if x is None else format(x, spec)


def section(results: dict) -> tuple[str, list[tuple[str, Any]]]:
    w, dp, m = results["width"], results["depth"], results["model"]
    ts = w["T"]
    tk = [str(t) for t in ts]
    res, fits = w["results"], w["fits"]
    quick = results.get("quick", False)
    mt = m["T"]

    # tables
    width_rows = []
    for t in tk:
        width_rows.append(
            [
                t,
                fmt_na(res["ln_full"]["with"][t]["cov_srank"]["mean"], ".4f"),
                fmt_na(res["ln_full"]["with"][t]["cov_srank_excess"]["mean"], ".2e"),
                fmt_na(res["ln_full"]["removed"][t]["cov_srank"]["mean"], ".1f"),
                fmt_na(res["ln_full"]["with"][t]["attn_srank"]["mean"], ".2f"),
                fmt_na(res["ln_full"]["removed"][t]["attn_srank"]["mean"], ".1f"),
                fmt_na(res["ln_full"]["with"][t]["sigma1"]["mean"], ".4f"),
                fmt_na(res["ln_full"]["with"][t]["gap"]["mean"], ".3f"),
                fmt_na(res["prop_full"]["with"][t]["cov_srank_excess"]["mean"], ".2e"),
                fmt_na(res["prop_full"]["removed"][t]["cov_srank"]["mean"], ".1f"),
                fmt_na(res["ln_causal"]["with"][t]["attn_srank"]["mean"], ".2f"),
                fmt_na(res["ln_causal"]["with"][t]["gap"]["mean"], ".3f"),
            ]
        )
    width_table = md_table(
        [
            "T",
            "sr(C), A",
            "sr(C) − 1, A",
            "sr(C), A − U",
            "sr(A)",
            "sr(A − U)",
            "σ₁(A)",
            "σ₁ − σ₂",
            "sr(C) − 1, A (d = T)",
            "sr(C), A − U (d = T)",
            "sr(A) causal",
            "σ₁ − σ₂ causal",
        ],
        width_rows,
    )
    fit_rows = [
        [
            LABELS[k],
            fmt_na(fits[k]["slope_cov_srank_excess_with"], "+.2f"),
            fmt_na(fits[k]["slope_cov_srank_removed"], "+.2f"),
            fmt_na(fits[k]["slope_out_srank_removed"], "+.2f"),
            fmt_na(fits[k]["cov_srank_removed_ratio_last_first"], ".1f"),
        ]
        for k in ("ln_full", "ln_causal", "unit_full", "prop_full")
    ]
    fit_table = md_table(
        [
            "series",
            "slope of sr(C) − 1 with A",
            "slope of sr(C) with A − U",
            "slope of sr(Y) with A − U",
            f"sr(C) at T={ts[-1]} / T={ts[0]}, A − U",
        ],
        fit_rows,
    )

    runs = dp["runs"]
    depth_rows = []
    for net in ("markov", "attention"):
        for gain in ("1", "bulk"):
            for variant in ("with", "removed"):
                r = runs[f"{net}_g{gain}_{variant}"]
                lg = r["ln_grad2"]
                fitted = r["slope_fitted_layers"]
                slope = fmt_na(r["slope_ln_grad2_per_layer"], "+.2f")
                if r["grad2_zero_from_layer"] is not None and fitted:
                    slope += f" (L = 2…{fitted[-1]})"
                depth_rows.append(
                    [
                        "i.i.d. Markov" if net == "markov" else "real attention",
                        "1" if gain == "1" else f"{dp['bulk_gain']:.2f}",
                        "A − U" if variant == "removed" else "A",
                        fmt_na(None if lg[0] is None else lg[0] / math.log(10), ".2f"),
                        fmt_na(None if lg[-1] is None else lg[-1] / math.log(10), ".2f"),
                        slope,
                        "none"
                        if r["grad2_zero_from_layer"] is None
                        else f"L = {r['grad2_zero_from_layer']} ({r['draws_zero_last']} of {dp['draws']} draws at L = {dp['layers']})",
                        fmt_na(r["cov_srank"][-1], ".2f"),
                    ]
                )
    depth_table = md_table(
        [
            "network",
            "gain g",
            "attention",
            "log10 ‖∇‖² at L=1",
            f"at L={dp['layers']}",
            "slope of ln ‖∇‖² per layer (L ≥ 2)",
            "‖∇‖ exactly 0 from",
            f"sr(C) of X_L at L={dp['layers']}",
        ],
        depth_rows,
    )

    model_rows = [
        [
            t,
            fmt_na(m["vanilla"][str(t)]["attn_srank"], ".2f"),
            fmt_na(m["causal_uniform"][str(t)]["attn_srank"], ".2f"),
            fmt_na(m["outlier_removed"][str(t)]["attn_srank"], ".2f"),
            fmt_na(m["vanilla"][str(t)]["attn_gap1"], ".3f"),
            fmt_na(m["causal_uniform"][str(t)]["attn_gap1"], ".3f"),
            fmt_na(m["outlier_removed"][str(t)]["attn_gap1"], ".3f"),
            fmt_na(m["vanilla"][str(t)]["logit_std"], ".3f"),
        ]
        for t in mt
    ]
    model_table = md_table(
        [
            "T",
            "attn_srank vanilla",
            "uniform causal",
            "attn_srank outlier_removed",
            "attn_gap1 vanilla",
            "uniform causal",
            "attn_gap1 outlier_removed",
            "logit std",
        ],
        model_rows,
    )

    fl, fp, fu, fc = fits["ln_full"], fits["prop_full"], fits["unit_full"], fits["ln_causal"]
    pred_gap = dp["predicted_slope_gap"]
    mg1w, mg1r = runs["markov_g1_with"], runs["markov_g1_removed"]
    mgbw, mgbr = runs["markov_gbulk_with"], runs["markov_gbulk_removed"]
    ag1w, ag1r = runs["attention_g1_with"], runs["attention_g1_removed"]
    agbw, agbr = runs["attention_gbulk_with"], runs["attention_gbulk_removed"]
    t_hi = tk[-1]
    ln_hi = res["ln_full"]
    draws_per_t = ", ".join(f"{t}: {w['draws'][str(t)]}" for t in ts)
    note = " (quick mode: small sizes, few draws; the numbers below are a smoke test, not the result)" if quick else ""
    text = f"""## Seed 003: rank collapse in width and the spectral gap at initialisation{note}

**Command:** `python -m experiments.seed003{" --quick" if quick else ""}` (one CPU thread, float64,
{results["wall_s"]:.0f} s), then `python -m experiments.report`. Seed {results["seed"]}, torch {results["torch"]}.

**The paper's claims.** For one softmax attention layer at initialisation with isotropic inputs
(orthonormal token rows, i.i.d. Gaussian weights), the attention matrix behaves like an i.i.d.
random Markov matrix: its top singular value escapes to 1 while the rest form a bulk that shrinks
like `1/sqrt(T)`, and this spectral gap makes the stable rank of the layer's output covariance
collapse to 1 as the context length `T` grows (at rate `O(T^-3)`). Subtracting the rank-one mean
component, `A - 1 1^T / T`, makes the stable rank grow linearly in `T`. In deep i.i.d. Markov
attention networks the squared gradient norm explodes exponentially with depth (like `T^(L-1)`),
and stays flat once the outlier is removed.

**Our setting.** `X` has orthonormal rows (`T <= d` always; no `T > d`), times a token scale;
`W_Q, W_K, W_V` i.i.d. `N(0, 1/d)`, `A = softmax(X W_Q W_K^T X^T / sqrt(d))` with `d_k = d` (one
head as wide as the model). Because `X` has orthonormal rows, `sqrt(d) X W_Q` has exactly i.i.d.
`N(0, 1)` entries, so the only free parameter is the logit variance `s^2`: tokens of norm `sqrt(d)`
(what LayerNorm gives) make it 1 (series *logit var 1*, `d = {w["d_fixed"]}` for every `T`); the
literal unit-norm rows make it `1/d^2` (series *logit var 1/d²*, same draws); and `d = T` with
`s^2 = 1/d` is the paper's proportional regime (series *logit var 1/T*). Stable rank of a matrix
`M` is `||M||_F^2 / ||M||_2^2`. *sr(C)* is the paper's quantity, the stable rank of the output
covariance `C = Y^T Y`, `Y = A X W_V` (it squares the singular values once more); *sr(A)* is the
agent's `attn_srank` (from `agent.metrics.attention_spectrum`). Draws per `T`: {draws_per_t};
means over draws below.

{width_table}

Log-log slopes against `T` (least squares over T = {ts[0]}…{ts[-1]}):

{fit_table}

![rank collapse in width](reproduction/seed003-width.png)

**What we find.** With the outlier, sr(C) → 1: at logit variance 1 it is
{ln_hi["with"][tk[0]]["cov_srank"]["mean"]:.3f} at T = {ts[0]} and {ln_hi["with"][t_hi]["cov_srank"]["mean"]:.4f} at T = {t_hi}.
The excess sr(C) − 1 falls like `T^{fl["slope_cov_srank_excess_with"]:.2f}` at fixed logit variance and like
`T^{fp["slope_cov_srank_excess_with"]:.2f}` when `d = T` and the logit variance is `1/d`: the paper's `T^-3` is
the second case. For small logit scale `s` the bulk singular values of `A` are about `s/sqrt(T)`
(`A - U ≈ L (I - U) / T` for logits `L`), so `sr(C) - 1 ≈ c s^4 / T`: the exponent 3 needs the
logit variance itself to shrink like `1/T`, as it does when `d = T` and the variance is `1/d`. At
`s = 1` the heavy-tailed exponentials slow the approach, and over this range the exponent is
{fl["slope_cov_srank_excess_with"]:.2f} rather than −1; at `s = 1/d` it is {fu["slope_cov_srank_excess_with"]:.2f} with an excess
of {res["unit_full"]["with"][t_hi]["cov_srank_excess"]["mean"]:.1e}: unit-norm tokens are collapsed from the start. With the outlier removed sr(C) grows
with slope {fl["slope_cov_srank_removed"]:.2f} (logit var 1), {fu["slope_cov_srank_removed"]:.2f} (1/d²) and
{fp["slope_cov_srank_removed"]:.2f} (d = T): close to linear, but below 1 at fixed `d` (the ratio `T/d`
grows along the sweep, and the spectrum of `A - U` widens). The matrix stable rank of `A` itself
(the agent's `attn_srank`) does *not* go to 1: it tends to `1 + ||A - U||_F^2 ≈ e^(s^2)` (2.72 at
logit variance 1); only the covariance, which squares the bulk once more, collapses.

**The gap.** At logit variance 1, σ₁(A) = {ln_hi["with"][t_hi]["sigma1"]["mean"]:.4f} and σ₁ − σ₂ =
{ln_hi["with"][t_hi]["gap"]["mean"]:.3f} at T = {t_hi}; σ₂ = {ln_hi["with"][t_hi]["sigma2"]["mean"]:.3f} against the i.i.d. bulk edge
`2 sqrt(e^(s^2) - 1) / sqrt(T)` = {2 * math.sqrt(math.e - 1) / math.sqrt(ts[-1]):.3f} (at T = {ts[0]}: {ln_hi["with"][tk[0]]["sigma2"]["mean"]:.3f}
against {2 * math.sqrt(math.e - 1) / math.sqrt(ts[0]):.3f}). Causal attention (our models) differs: the uniform causal
matrix `U_ij = 1/(i+1)` is not rank one, its σ₁ grows toward 2 (Hardy's inequality), the gap
*shrinks* with `T` ({res["ln_causal"]["with"][tk[0]]["gap"]["mean"]:.3f} → {res["ln_causal"]["with"][t_hi]["gap"]["mean"]:.3f}), and sr(C)
does not collapse ({res["ln_causal"]["with"][tk[0]]["cov_srank"]["mean"]:.2f} → {res["ln_causal"]["with"][t_hi]["cov_srank"]["mean"]:.2f}). Subtracting the causal `U`
helps much less than in the non-causal case: sr(C) goes {res["ln_causal"]["removed"][tk[0]]["cov_srank"]["mean"]:.2f} →
{res["ln_causal"]["removed"][t_hi]["cov_srank"]["mean"]:.2f} (slope {fc["slope_cov_srank_removed"]:.2f}) and sr(A − U) {res["ln_causal"]["removed"][tk[0]]["attn_srank"]["mean"]:.1f} →
{res["ln_causal"]["removed"][t_hi]["attn_srank"]["mean"]:.1f} (slope {fc["slope_attn_srank_removed"]:.2f}).

![spectral gap](reproduction/seed003-gap.png)

**Depth.** `X_(l+1) = g A_l X_l W_l` with orthogonal `W_l`, no residual, no LayerNorm, `T = {dp["T"]}`,
`d = {dp["d"]}`, {dp["draws"]} draws (geometric means), loss `<R, X_L>` for a fixed Gaussian `R`,
`||d loss / d X_0||_F^2` by autograd (for the i.i.d. Markov network it matches the closed form
`||A_1^T ... A_L^T R||_F^2` to {fmt_na(dp["closed_form_rel_err_max"], ".1e")}). *i.i.d. Markov*: `A_l` is the softmax of
i.i.d. N(0, 1) logits, independent of `X` (the paper's model); *real attention*: fresh `W_Q, W_K`
per layer and logits from `X_l`. Gain `g = 1` is the standard initialisation;
`g = sqrt(T / E||A - U||_F^2) = {dp["bulk_gain"]:.2f}` makes the outlier-free layer norm-preserving,
the normalisation in which the paper's statement reads as written.

{depth_table}

![gradient norm against depth](reproduction/seed003-depth.png)

In the i.i.d. Markov network the gap between the two variants is exactly the outlier: per layer, the
outlier carries the gradient at gain `g` while the bulk carries it at `g sqrt(E||A - U||_F^2 / T)`, so
the log-slopes differ by `ln(T / E||A - U||_F^2) = {pred_gap:.2f}`. At `g = 1`: with the outlier
{fmt_na(mg1w["slope_ln_grad2_per_layer"], "+.2f")} per layer (flat), without {fmt_na(mg1r["slope_ln_grad2_per_layer"], "+.2f")}
(vanishing; predicted {-pred_gap:+.2f}). At the bulk gain: with {fmt_na(mgbw["slope_ln_grad2_per_layer"], "+.2f")}
(exploding; predicted {pred_gap:+.2f}, i.e. a factor `~T` per layer, the paper's `T^(L-1)`), without
{fmt_na(mgbr["slope_ln_grad2_per_layer"], "+.2f")} (flat). The output's sr(C) is 1 after one or two layers with the
outlier and stays above 1 without it. Real attention without LayerNorm does not follow the i.i.d.
model, because its logits scale with the token norms. At `g = 1` with the outlier the gradient is
flat ({fmt_na(ag1w["slope_ln_grad2_per_layer"], "+.2f")} per layer) as in the i.i.d. model; without it the tokens shrink,
the logits go to 0, `A` goes to `U` and the gradient vanishes faster than exponentially
({"exactly 0 from L = " + str(ag1r["grad2_zero_from_layer"]) if ag1r["grad2_zero_from_layer"] else fmt_na(ag1r["slope_ln_grad2_per_layer"], "+.2f") + " per layer"}).
At the bulk gain the token norms, and with them the logits, grow, so both variants explode
({fmt_na(agbw["slope_ln_grad2_per_layer"], "+.2f")} and {fmt_na(agbr["slope_ln_grad2_per_layer"], "+.2f")} per layer); the softmax saturates until every
query attends to the same key, `A ≈ 1 e_j^T`, a rank-one matrix that subtracting `U` does not
remove: the tokens become identical, and the next `A - U` maps identical tokens to exactly 0
({"in " + str(agbr["draws_zero_last"]) + " of " + str(dp["draws"]) + " draws from L = " + str(agbr["grad2_zero_from_layer"]) if agbr["grad2_zero_from_layer"] else "in none of the draws here"}).

**The project's model.** `trainer`'s GPT in the `{m["recipe"]}` shape (d_model {m["shape"]["d_model"]},
{m["shape"]["n_heads"]} heads of {m["shape"]["d_head"]}, {m["shape"]["n_layers"]} layers; causal, RoPE, pre-LayerNorm,
GPT-2 initialisation with std 0.02 on every layer), random byte tokens, the agent's metrics from the
queries and keys the model uses, mean over layers and heads:

{model_table}

![the project's model at initialisation](reproduction/seed003-model.png)

At init the logits have a standard deviation of about {m["vanilla"][str(mt[-1])]["logit_std"]:.2f} (the queries and keys
are `0.02`-scale projections), so attention is almost exactly uniform causal: `attn_srank` and
`attn_gap1` of the vanilla model equal those of `U_ij = 1/(i+1)` (growing like `log T` and
shrinking, respectively), not the non-causal rank-one picture. With `model.variant=outlier_removed`
`attn_srank` grows with `T` (slope {m["slope_removed_attn_srank"]:.2f} on log-log) and the gap is near 0. These are
whole-sequence values; the agent's probe measures the first `spectrum_window` (256) tokens, so for
longer contexts it reports the T = 256 row.

**Scale.** Single layers up to `T = {ts[-1]}` with `d = {w["d_fixed"]}` and a {dp["layers"]}-layer stack at
`T = {dp["T"]}` instead of the paper's asymptotic limits and its BERT-scale experiments; everything at
initialisation, as in the paper. **Did it carry over?** Yes for the non-causal model the paper
analyses: the covariance stable rank collapses to 1 with the outlier and grows close to linearly
without it (log-log slope {min(fl["slope_cov_srank_removed"], fp["slope_cov_srank_removed"]):.2f}–{max(fl["slope_cov_srank_removed"], fp["slope_cov_srank_removed"]):.2f};
{min(fl["slope_attn_srank_removed"], fp["slope_attn_srank_removed"]):.2f}–{max(fl["slope_attn_srank_removed"], fp["slope_attn_srank_removed"]):.2f} for the stable rank of `A - U` itself), the gap approaches 1, and in the i.i.d. Markov network the outlier is what separates an
exploding (or, at gain 1, flat) gradient from a flat (vanishing) one; the `T^-3` rate holds only when
the logit variance scales like `1/T`, and the picture changes for causal attention and for real
attention stacked without normalisation.
"""
    return text, figures(results)
