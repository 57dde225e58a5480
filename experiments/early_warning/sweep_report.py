"""docs/instability.md from the sweep's committed files alone (issue 31).

``python -m experiments.instability --report`` scores the sweep again from
``experiments/results/instability_sweep_runs.npz`` and ``instability_sweep_outcome.json``
(``experiments.sweep_analysis.score_sweep``), writes ``instability_sweep.json`` and this page.
Every number on the page comes from those results; every sentence that judges (met, not met, an
order between variants) is computed from the same numbers, so the page cannot say more than the data.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.common import ROOT
from experiments.early_warning import yardstick_report
from experiments.early_warning.yardstick_report import pct, table

DOCS = ROOT.parent / "docs"
LABELS = ("diverged", "degraded", "spiked", "healthy")
SHORT = {"diverged": "div", "degraded": "deg", "spiked": "spk", "healthy": "ok"}
ORDER = ("tune", "test", "holdout")


def page(r: Mapping[str, Any], yardstick: Mapping[str, Any] | None = None) -> str:
    """The page: with issue 40's results, they come first and the tune recipe's sweep follows as its
    detail (its own scoreboard, against issue 31's loss alert, superseded); without them, the sweep alone."""
    if yardstick is None:
        return "\n".join(
            [
                intro(r),
                judged_section(r),
                ended_section(r),
                sensitivity_section(r),
                scoreboard_section(r),
                forecast_section(r.get("forecast_baseline")),
                limits_section(r),
            ]
        )
    return "\n".join(
        [
            yardstick_report.section(yardstick),
            intro(r, title="## The tune recipe: the learning-rate sweep of issue 31")
            + "\nIssue 31 split its seeds as above; the scoreboard at the top of this page tunes on seeds 0-2 and "
            "keeps seed 3 as an in-recipe check.\n",
            judged_section(r, level="###"),
            ended_section(r, level="###"),
            sensitivity_section(r, level="###"),
            superseded_section(r, yardstick),
            forecast_section(r.get("forecast_baseline"), level="###"),
            limits_section(r, level="###"),
        ]
    )


def write(results: Mapping[str, Any], docs: Path = DOCS, yardstick: Mapping[str, Any] | None = None) -> Path:
    path = docs / "instability.md"
    path.write_text(page(results, yardstick))
    return path


def superseded_section(r: Mapping[str, Any], y: Mapping[str, Any]) -> str:
    """Issue 31's scoreboard, named for what it was: leads against a loss alert that is a near-clock."""
    from experiments.early_warning.yardstick_scoring import OLD_ALERT

    alarms = [y["parts"][p]["rows"][OLD_ALERT]["hot"] for p in ("tune", "tune_seed3")]
    fired, healthy = sum(a["false_alarms"] for a in alarms), sum(a["healthy"] for a in alarms)
    steps = sorted(s for a in alarms for s in a["false_alarm_steps"])
    span = f"at steps {steps[0]}-{steps[-1]}" if steps else ""
    return f"""### Issue 31's scoreboard, superseded

Issue 31 scored its rules against its own loss-only alert (`LossAlert`: a rise of 0.5 nats, or a fall of
less than 0.02 nats in 100 steps between step 100 and three quarters of the run). That alert fired on
{fired} of the {healthy} healthy runs of this sweep (counted as above) {span}, where the cosine schedule
flattens every run: a near-clock, not a yardstick. Its scoreboard stays in
`experiments/results/instability_sweep.json`; the scoreboard that counts is the one at the top of this
page, against a loss-only baseline tuned like the rules, on recipes nothing was tuned on.
"""


def intro(
    r: Mapping[str, Any], title: str = "# Instabilities qkwatch did not make, judged by where each run ends"
) -> str:
    runs = r["runs"]
    variants = sorted({x["variant"] for x in runs})
    rates = sorted({x["lr"] for x in runs})
    seeds = Counter(x["split"] for x in runs)
    return f"""{title}

A learning-rate sweep in the style of Wortsman et al. 2023 ("Small-scale proxies for large-scale
Transformer training instabilities", arXiv 2309.14322): {len(runs)} runs of `instability_small`
(6 layers of d_model 96, byte-level text, 800 steps with 5 % warmup and cosine decay, AdamW
0.9/0.95, clip 1.0, the held-out loss every 50 steps, a report every 10), over
{", ".join(variants)}, at {len(rates)} rates from {rates[0]:g} to {rates[-1]:g} in half-decade steps,
four seeds each: seed 0 chooses the detectors' parameters ({seeds["tune"]} runs), seeds 1 and 2 test
them ({seeds["test"]}), seed 3 is held out and scored once ({seeds["holdout"]}). **Nothing is induced**:
every bad run here went bad by its own training. The runs and every step of them are in
`experiments/results/instability_sweep_runs.npz`; everything below is recomputed from that file and
`experiments/results/instability_sweep_outcome.json` alone.

```
python -m experiments.instability --runs experiments/instability_sweep.yml --campaign instability_sweep --train-only
python -m experiments.sweep_analysis --export        # the trained runs, every step, into the npz
python -m experiments.sweep_analysis --fix-outcome   # once, before any scoring: best rates, spread, delta
python -m experiments.instability --report           # this page, from the committed files alone
```
"""


def judged_section(r: Mapping[str, Any], level: str = "##") -> str:
    o = r["outcome"]
    best = o["best_rates"]
    groups = o["finals_at_best"]
    rows = [[v, f"{best[v]:g}", ", ".join(f"{x:.3f}" for x in groups[v])] for v in sorted(best)]
    n = sum(len(g) for g in groups.values())
    return f"""{level} How a run is judged

Fixed before any detector was scored (`qkwatch/client/outcomes.py`, and the commit of
`instability_sweep_outcome.json` comes before the commit of any score):

* **diverged**: a non-finite loss, or a run that did not train (the smoothed loss ends within 0.5
  nats of the first); **spiked**: the loss smoothed over 20 steps rose 0.5 nats above its running
  minimum for 5 steps and came back (both as before);
* **degraded**: the run's *final held-out loss*, the mean of its last {o["k"]} evaluations, is at least
  **delta = {o["delta"]:g} nats** above its reference's, the reference being the same variant and seed at
  the variant's best rate. delta is {o["rule"]}: the pooled standard deviation over {n} runs is
  **{o["spread"]:.4f}**, and 3 x sqrt(2) x {o["spread"]:.4f} = {3 * math.sqrt(2) * o["spread"]:.4f}, rounded up.
  A run both spiked and degraded is degraded; a run at its variant's best rate is its own reference.

{table(["variant", "best rate", "final held-out loss there, seeds 0-2"], rows)}

**The loss-visible step** is what a user who watches only the loss is told, and when: a loss-only alert
(`LossAlert`) fires at a non-finite loss; or when the loss smoothed over 20 steps is 0.5 above its
running minimum for 5 steps; or when, between step 100 and three quarters of the run, it fell by less
than 0.02 nats in 100 steps. A detector's **lead** on a bad run is that step (the end of the run when the
loss never showed it) minus the step of its first alert; negative means qkwatch was later than the loss.

**The bar**, fixed before the suite ran: on the held-out seed, at least {pct(r["bar"]["flagged"])} of the bad
runs flagged, a median lead of at least {r["bar"]["median_lead_steps"]} steps, and at most one false alarm (an
alert on a healthy run) in {round(1 / r["bar"]["false_alarm_rate"])} runs. A rule that does not meet it is not a default.
"""


def ended_section(r: Mapping[str, Any], level: str = "##") -> str:
    runs = r["runs"]
    variants = sorted({x["variant"] for x in runs})
    rates = sorted({x["lr"] for x in runs})
    header = ["rate", *variants]
    rows = []
    for lr in rates:
        cells = [f"{lr:g}"]
        for v in variants:
            cell = [x for x in runs if x["variant"] == v and x["lr"] == lr]
            finals = [x["final"] for x in cell if x["final"] is not None]
            counts = Counter(x["outcome"] for x in cell)
            mark = ", ".join(f"{counts[k]} {SHORT[k]}" for k in LABELS if counts[k])
            mean = f"{statistics.fmean(finals):.3f}" if finals else "-"
            sd = f" ± {statistics.stdev(finals):.3f}" if len(finals) > 1 else ""
            cells.append(f"{mean}{sd} ({mark})")
        rows.append(cells)
    total = Counter(x["outcome"] for x in runs)
    return f"""{level} Where the runs ended

The final held-out loss, mean ± standard deviation over the four seeds, and the outcomes counted over
the four seeds (div: diverged, deg: degraded, spk: spiked, ok: healthy). In all: {", ".join(f"{total[k]} {k}" for k in LABELS)}.

{table(header, rows)}
"""


def sensitivity_section(r: Mapping[str, Any], level: str = "##") -> str:
    s = r["lr_sensitivity"]
    rows = [
        [
            v,
            f"{x['mean']:.3f}",
            f"{x['sd']:.3f}" if x["sd"] is not None else "-",
            ", ".join(f"{y:.3f}" for y in x["per_seed"].values()),
        ]
        for v, x in sorted(s.items(), key=lambda kv: kv[1]["mean"])
    ]
    return f"""{level} Learning-rate sensitivity

Wortsman et al.'s measure per variant and seed: the mean over the swept rates of min(final held-out
loss, loss at initialisation) minus the best final, in nats; then the mean and standard deviation
over the four seeds. {order_sentence(s)}

{table(["variant", "mean", "sd over seeds", "per seed (0-3)"], rows)}
"""


def order_sentence(s: Mapping[str, Any]) -> str:
    """An order between two variants is claimed only where every seed of one is below every seed of the other."""
    names = sorted(s, key=lambda v: s[v]["mean"])
    claims = []
    for a, b in itertools.pairwise(names):
        if max(s[a]["per_seed"].values()) < min(s[b]["per_seed"].values()):
            claims.append(f"{a} is less sensitive than {b} on every seed")
        else:
            claims.append(f"{a} and {b} overlap across seeds (no order claimed)")
    return "Between neighbours in the table: " + "; ".join(claims) + "."


def scoreboard_section(r: Mapping[str, Any]) -> str:
    parts = ["## Detectors against the baselines a user already has\n"]
    chosen = r["chosen"]
    names = ", ".join(f"`{k}` {rule_text(c['rule'])}" for k, c in chosen.items()) or "none"
    parts.append(
        "Each candidate family's parameters were chosen on seed 0 (most bad runs flagged with no alert on a "
        "healthy run); the collapse rules (`qkai_high`, `collapse_band`) are the user's and are not tuned. "
        f"Chosen: {names}. "
        f"The rate baseline alerts from the first step on every run at a rate of at least {r['lr_threshold']:g} "
        "(the smallest swept rate above every healthy tune run's). Rows named `detectors.yml:<rule>` are the "
        "candidate detectors' file as users get it (`qkwatch serve --rules`, and `qkwatch demo --natural`), "
        'scored as they are, untuned; they are not in the "any chosen or collapse rule" row.\n'
    )
    for split, title in (("test", "Test seeds 1 and 2"), ("holdout", "The held-out seed 3, scored once")):
        table_ = r["tables"][split]
        rows = []
        for rule, s in table_.items():
            rows.append(
                [
                    f"{rule}{' (baseline)' if s['baseline'] else ''}",
                    f"{s['flagged']}/{s['bad']} ({pct(s['flagged_fraction'])})",
                    "-" if s["median_lead_steps"] is None else f"{s['median_lead_steps']:g}",
                    f"{s['false_alarms']}/{s['runs']}",
                    "yes" if s["meets_bar"] else "no",
                    "-" if s["baseline"] else ("yes" if s["beats_baselines"] else "no"),
                ]
            )
        parts.append(
            f"### {title}\n\n{table(['rule', 'bad runs flagged', 'median lead (steps)', 'false alarms', 'meets the bar', 'beats every baseline'], rows)}\n"
        )
    parts.append(verdict(r))
    return "\n".join(parts)


def verdict(r: Mapping[str, Any]) -> str:
    """Whether any rule ships as a default: it meets the bar and beats every baseline on the held-out seed."""
    held = r["tables"]["holdout"]
    ours = {k: v for k, v in held.items() if not v["baseline"]}
    met = [k for k, v in ours.items() if v["meets_bar"]]
    default = [k for k, v in ours.items() if v["default"]]
    base = [k for k, v in held.items() if v["baseline"] and v["meets_bar"]]
    lines = [
        "A rule ships as a default only when, on the held-out seed, it meets the bar **and** beats every "
        "baseline (flags more bad runs with no more false alarms, or as many with fewer); both fixed before "
        "the suite ran."
    ]
    if default:
        lines.append(
            f"**On the held-out seed {', '.join(f'`{k}`' for k in default)} meet the bar and beat the baselines.**"
        )
    elif met:
        lines.append(
            f"**On the held-out seed {', '.join(f'`{k}`' for k in met)} meet the bar but do not beat every baseline, "
            "so no rule ships as a default from this suite.**"
        )
    else:
        lines.append(
            "**On the held-out seed no qkwatch rule meets the bar, so none ships as a default from this suite.**"
        )
    lines.append(f"Baselines meeting the bar: {', '.join(f'`{k}`' for k in base) or 'none'}.")
    return " ".join(lines) + "\n"


def forecast_section(f: Mapping[str, Any] | None, level: str = "##") -> str:
    if f is None:
        return f"{level} The QKAI forecast against the constant guess\n\nNot measured yet (`python -m experiments.forecast_baseline`).\n"
    rule = {k: v for k, v in f["rule"].items() if k != "name"}
    lo_hi = f["difference_interval"]
    interval = (
        f"a 95 % bootstrap interval over the test runs of {lo_hi[0]:+.2f} to {lo_hi[1]:+.2f} for the difference of the medians"
        if lo_hi
        else "too few runs for an interval"
    )
    verdict_ = (
        "**The forecast beats the constant guess on the held-out seeds**, and stays among the suggested rules."
        if f["forecast_beats_constant"]
        else "**The forecast does not beat the constant guess on the held-out seeds**, so it is not a default and "
        "its line in `detectors.yml` says so."
    )
    return f"""{level} The QKAI forecast against the constant guess (**induced** collapse band)

No run of the sweep raised QKAI to the collapse threshold ({f["threshold"]:g}) on its own, so the forecast
is scored where QKAI does cross: the demo's **induced** collapse band (`collapse_cpu`, seeds 0-7 tune,
8-11 test, every step in `experiments/results/instability_collapse_runs.npz`;
`python -m experiments.forecast_baseline`). The forecast is `qkai_forecast` of `detectors.yml` as shipped
{rule_text(rule)}, chosen on the tune seeds. The baseline, fixed before it was computed: **the constant
guess** "a layer that crosses does so at step {f["constant_guess_step"]:g}", the median first crossing over
the tune runs' layers. Both are scored at the moments the forecast fired on a test run whose layer then
crossed, by |predicted - actual| / (actual - fired).

{
        table(
            ["", "median relative error", "over"],
            [
                [
                    "qkai_forecast",
                    pct(f["forecast_median_error"]),
                    f"{f['scored']} forecasts, {len(f['test_runs'])} runs",
                ],
                ["constant guess", pct(f["constant_median_error"]), "the same forecasts"],
            ],
        )
    }

The forecast was closer on {f["forecast_wins"]} of {f["scored"]}; {interval}. Its forecasts looked a median
{f["median_lead_steps"]:g} steps ahead; {f["never_crossed"]} forecasts were of a layer that never crossed, and
{len(f["crossings_without_forecast"])} of the test runs' {
        f["test_layers_crossed"]
    } crossings had no forecast before them.
{verdict_}
"""


def limits_section(r: Mapping[str, Any], level: str = "##") -> str:
    runs = r["runs"]
    qkai = [x["peaks"]["qkai"] for x in runs if x["peaks"]["qkai"] is not None]
    top = max(qkai) if qkai else None
    crossed = sum(1 for v in qkai if v > r["collapse_threshold"])
    if top is None:
        band = "no run reported QKAI."
    elif crossed:
        band = (
            f"{crossed} of {len(runs)} runs raised QKAI past the collapse threshold on their own (largest {top:.3f})."
        )
    else:
        band = (
            f"No run here raised QKAI past the collapse threshold on its own (the largest, over every run, layer "
            f"and report: {top:.3f}), so the QKAI rules are scored only on trouble of another kind (a rule that "
            "never fires flags nothing)."
        )
    return f"""{level} What this does not show

* Nothing at scale: a 6-layer model of width 96 on byte-level text for 800 steps, on a CPU. The
  variants' order, the rates and the detectors' parameters may all differ on a real model.
* Nothing about the collapse band of the papers: {band} The induced band (the demo's) is not in this sweep.
* One run per seed and cell: the outcome of a cell is four runs, and the held-out seed is one run per cell.
"""


def rule_text(rule: Mapping[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in rule.items() if k != "name") + ")"
