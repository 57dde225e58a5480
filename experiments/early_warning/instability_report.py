"""docs/instability-earlier.md and its figures, from ``experiments/results/instability.json`` alone.

``python -m experiments.instability --report`` calls :func:`write`; the full suite calls it after
its analysis. Every number on the page is read from the results file; sentences that judge a
result (met, not met, none diverged) are computed from the same numbers, so the page cannot say
more than the data.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.common import ROOT, log
from experiments.early_warning.instability_forecast_report import (
    GOAL,
    first_forecast_section,
    forecast_section,
    markdown_table,
    pct,
    rerun_section,
    rule_text,
)

DOCS = ROOT.parent / "docs"
FIGURES = "instability"


PAGE = "instability-earlier.md"
"""The earlier suite's page (60 runs of instability_cpu, spikes only); docs/instability.md is the sweep's."""


def write(results: dict[str, Any], docs: Path = DOCS, png: bool = True, command: str = "") -> Path:
    text, figures = page(results, command)
    out = docs / FIGURES
    out.mkdir(parents=True, exist_ok=True)
    if png:
        os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
        for name, fig in figures:
            fig.write_image(out / f"{name}.png", scale=1)
    path = docs / PAGE
    path.write_text(text)
    log(f"wrote {path} ({len(figures)} figures{'' if png else ', PNGs not exported'})")
    return path


def page(r: dict[str, Any], command: str) -> tuple[str, list[tuple[str, Any]]]:
    parts = [
        intro(r, command),
        runs_section(r),
        detectors_section(r),
        induced_section(r),
        forecast_section(r),
        first_forecast_section(),
        lr_section(r),
        rerun_section(r),
        contraction_section(r),
        limits_section(r),
    ]
    return "\n".join(parts), [("lr-sensitivity", lr_figure(r)), ("bad-runs", bad_runs_figure(r))]


def intro(r: dict[str, Any], command: str) -> str:
    runs = r["runs"]
    return f"""# The earlier instability suite (spikes only)

**Superseded by the sweep judged by where each run ends (`docs/instability.md`).** This suite judged a run
by its loss spikes alone, so a run that ended a nat worse than its twin counted as healthy, and most
of its "false alarms" may have been runs that really ended worse (issue 31). It is kept as it was
measured; its numbers are not the project's current claims. Its results file,
`experiments/results/instability.json`, is the 60-run record of commit 0c76f27, made with the runs
file of that commit: there the demo's collapse band had two seeds, `collapse-vanilla-s0` (tune) and
`collapse-vanilla-s1` (test), and every table below follows that split. The runs file has changed
since (twelve collapse seeds, of which s1 is now a tune run; the learning-rate runs moved to
`experiments/instability_sweep.yml`) and was not rerun as a whole; the forecast's later protocol
on those twelve seeds is in the forecast section, from its own results file.

The instability suite trains {len(runs)} runs into one collector through the agent and reads them
back over REST (`experiments/instability.py`; the runs are `experiments/instability_runs.yml`).
Most of the trouble comes from the training itself: a learning-rate sweep in the style of
Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities",
arXiv 2309.14322) over vanilla attention, qk_norm, sigma_reparam and RAA, and no learning-rate
warmup at a high rate. Two pressures are qkwatch's own and are labelled **induced** wherever they
appear: the key contraction of `collapse_cpu` without its alignment term, and the demo's collapse
band (`collapse_cpu` as the demo runs it, where QKAI crosses the collapse threshold, so that a
forecast's predicted crossing can be checked); induced runs are kept out of the detectors' choice
and scores. Healthy controls train twice as long at a safe rate. Every run has two seeds; seed 0
is the `tune` split (where each detector's parameters are chosen) and seed 1 the `test` split
(where they are reported). The demo's collapse band has twelve, for the forecast: seeds 0-7 are
its tune runs and seeds 8-11 its test runs.

Regenerate (about 75 CPU minutes: some 45 minutes on 2 idle cores, 85 on a loaded machine; resumable):

```
{command or "python -m experiments.instability --runs experiments/instability_runs.yml"}
{command or "python -m experiments.instability --runs experiments/instability_runs.yml"} --forecast   # the collapse-band runs: the forecast
{command or "python -m experiments.instability --runs experiments/instability_runs.yml"} --report     # this page from the committed results
```

## How a run is judged

The outcome comes from the logged training loss alone (`qkwatch/client/outcomes.py`), by a rule fixed
before any detector was scored on the suite, and not moved since: `{r["outcome_rule"]}`. A
non-finite loss, or a run that did not train, *diverged*; otherwise the loss is smoothed by a
trailing mean of `window` logged values, and an *excursion* is a smoothed loss at least `delta`
nats above its running minimum for `for` consecutive logged steps; the first excursion *spiked*
the run if the smoothed loss came back below that line, else the run *diverged* there. No
excursion: *healthy*. Every logged loss is stored (the agent keeps every step's value), so the
rule sees every step.

The rule was revised once, before any detector was scored: its first version (commit 924f0e1)
did not smooth, and assumed a batch's loss varies by 0.05 nats; on this data it varies by about
0.2, with rare easy batches 0.6 lower, and the first version called 11 of the first 20 runs
"spiked" from batch noise alone. `qkwatch/client/outcomes.py` records the measurement and the revision.
"""


def runs_section(r: dict[str, Any]) -> str:
    rows = []
    groups: dict[tuple[str, str, bool], Counter[str]] = {}
    for run in r["runs"]:
        groups.setdefault((run["pressure"], run["variant"], run["induced"]), Counter())[run["outcome"]] += 1
    for (pressure, variant, induced), c in groups.items():
        label = f"{pressure} (**induced**)" if induced else pressure
        rows.append([label, variant, c["diverged"], c["spiked"], c["healthy"]])
    table = markdown_table(["pressure", "variant", "diverged", "spiked", "healthy"], rows)
    bad = [x for x in r["runs"] if x["outcome"] != "healthy"]
    listing = markdown_table(
        ["run", "split", "outcome", "step", "why"],
        [[x["name"], x["split"], x["outcome"], x["outcome_step"], x["why"]] for x in bad],
    )
    none = "" if bad else "\n**No run went bad.** Every run of the suite is healthy by the outcome rule.\n"
    return f"""## What happened to the runs

{table}
{none}
The runs that went bad:

{listing if bad else "(none)"}

![Loss of every run that went bad, with the first alert of the default rules](instability/bad-runs.png)
"""


def detectors_section(r: dict[str, Any]) -> str:
    chosen = r["chosen"]
    rows = [[f, rule_text(c["rule"]), pct(c["tune"]["recall"]), c["tune"]["false_alarms"]] for f, c in chosen.items()]
    unchosen = [f for f in r["families"] if f not in chosen]
    test = {s["rule"]: s for s in r["test"]["scores"]}
    score_rows = [
        [
            name,
            f"{s['flagged']}/{s['bad_runs']}",
            pct(s["recall"]),
            s["late"],
            f"{s['false_alarms']}/{s['healthy_runs']}",
            _num(s["median_lead_steps"]),
            _num(s["median_lead_reports"]),
        ]
        for name, s in test.items()
    ]
    quiet = []
    for family, candidates in r.get("candidates_on_test", {}).items():
        best = min(candidates, key=lambda c: (c["score"]["false_alarms"], -c["score"]["flagged"]))
        s = best["score"]
        quiet.append(
            [
                family,
                rule_text(best["rule"]),
                f"{s['false_alarms']}/{s['healthy_runs']}",
                f"{s['flagged']}/{s['bad_runs']}",
                s["late"],
            ]
        )
    verdict = _verdict(test.get("(any rule)"))
    bad = [x for x in r["runs"] if x["outcome"] != "healthy"]
    early = [x for x in bad if (x.get("reports_before_outcome") or 0) <= 1]
    if bad:
        verdict += (
            f"\n\n{len(early)} of the {len(bad)} runs that went bad (both splits) had at most one report before "
            "their outcome, the report at step 0 of the untrained model: no rule can warn of those early, "
            "whatever its parameters."
        )
    return f"""## Detectors: chosen on tune, scored on test

Each family's candidates are listed in `experiments/early_warning/detectors.py` (`FAMILIES`). On the tune
split a family takes the candidate that flags the most bad runs before their outcome while firing
on no healthy run (ties: the longer median lead, then the more conservative candidate); a family
where no candidate does that is left out of the defaults. The user's `qkai_high` (`qkai > {r["collapse_threshold"]:.2f}`
for 3 reports) and `collapse_band` are kept as they are.

{markdown_table(["family", "chosen rule", "tune recall", "tune false alarms"], rows) if rows else "No family was chosen."}

Not chosen (no candidate flagged a bad tune run without a false alarm): {", ".join(unchosen) or "none"}.

On the **test** split, the default rules (the user's two plus those chosen):

{markdown_table(["rule", "flagged before outcome", "recall", "late", "false alarms (healthy runs)", "median lead (steps)", "median lead (reports)"], score_rows)}

{verdict}

Why nothing was chosen, family by family: each family's quietest candidate on the **test** split
(the fewest firings on healthy runs), how many healthy runs it still fired on, and how it did on
the bad ones. A detector that fires on most healthy runs would page on most healthy trainings.

{markdown_table(["family", "quietest candidate", "false alarms (healthy runs)", "flagged before outcome", "late"], quiet)}

Every candidate's test score is in `experiments/results/instability.json` (`candidates_on_test`).
"""


def _verdict(any_rule: dict[str, Any] | None) -> str:
    goal = (
        f"The bar (fixed before the suite ran): at least {GOAL['recall']:.0%} of the bad test runs flagged "
        f"before their outcome, a median lead of at least {GOAL['lead_reports']} reports, and no firing on a "
        "healthy test run."
    )
    if any_rule is None or not any_rule["bad_runs"]:
        return f"{goal} **It cannot be judged: no test run went bad.**"
    met = (
        (any_rule["recall"] or 0) >= GOAL["recall"]
        and (any_rule["median_lead_reports"] or 0) >= GOAL["lead_reports"]
        and any_rule["false_alarms"] == GOAL["false_alarms"]
    )
    got = (
        f"The default rules flagged {any_rule['flagged']} of {any_rule['bad_runs']} bad test runs before their "
        f"outcome ({pct(any_rule['recall'])}), with a median lead of {_num(any_rule['median_lead_reports'])} "
        f"reports, and fired on {any_rule['false_alarms']} of {any_rule['healthy_runs']} healthy test runs."
    )
    return f"{goal} {got} **{'Met.' if met else 'Not met.'}**"


def induced_section(r: dict[str, Any]) -> str:
    """What the default rules made of the induced runs (kept out of the detectors' scores)."""
    runs = (r.get("induced") or {}).get("runs") or []
    if not runs:
        return ""
    rows = []
    for run in runs:
        fired = [f"{x['rule']} (step {x['first_fire_step']})" for x in run["rules"] if x["first_fire_step"] is not None]
        rows.append([run["run"].split("/")[-1], run["outcome"], ", ".join(fired) or "none"])
    return f"""## The induced runs (**induced**), apart

The key contraction and the demo's collapse band are qkwatch's own interventions, so they are kept
out of the detectors' choice and scores above. Their losses stay healthy (the band does not show
in the loss in so few steps); what the default rules did on them:

{markdown_table(["run (**induced**)", "outcome by the loss", "default rules fired (first step)"], rows)}
"""


def lr_section(r: dict[str, Any]) -> str:
    sens = r["lr_sensitivity"]
    rows = [[v, _num(s["sensitivity"], 3), ", ".join(_num(x, 3) for x in s["per_seed"])] for v, s in sens.items()]
    lrs = sorted({float(lr) for s in sens.values() for lr in s["curve"]})
    curve_rows = [[v, *(_num(s["curve"].get(str(lr), s["curve"].get(lr)), 3) for lr in lrs)] for v, s in sens.items()]
    return f"""## Learning-rate sensitivity

Wortsman et al.'s LR sensitivity: over the swept peak rates, the mean of `min(loss, loss at
init) - best loss`, from each run's last validation loss; per seed, then the mean over the two.
Lower is less sensitive.

{markdown_table(["variant", "LR sensitivity (nats)", "per seed"], rows)}

Final validation loss (mean over seeds) per peak learning rate:

{markdown_table(["variant", *(f"{lr:g}" for lr in lrs)], curve_rows)}

![Final loss against the peak learning rate, per variant](instability/lr-sensitivity.png)
"""


def contraction_section(r: dict[str, Any]) -> str:
    if not r["contraction"]:
        return "## RAA on the key-contraction band (**induced**)\n\nThis suite has no key-contraction runs.\n"
    rows = [
        [
            x["run"],
            x["variant"],
            x["qkai"].get("step", x["step"]),
            _num(x["qkai"]["band"], 3),
            _num(x["stable_rank"]["band"], 2),
            _num(x["band_stable_rank_min"], 2),
            _num(x["stable_rank"]["rest"], 2),
            _num(x["attn_entropy"]["band"], 3),
            _num(x["attn_entropy"]["rest"], 3),
            _num(x["par"]["band"], 4),
            _num(x.get("band_par_max"), 4),
            _num(x["val_loss"], 3),
        ]
        for x in r["contraction"]
    ]
    return f"""## RAA on the key-contraction band (**induced**)

The contraction shrinks the key projections of layers 3-5 toward rank one (an intervention of
qkwatch's, so **induced**), without the alignment term that drives the demo's QKAI up. The band's
geometry at the last report that measured it (its step is given), against the other layers:

{markdown_table(["run", "variant", "step", "band QKAI", "band stable rank", "band stable rank, lowest", "others' stable rank", "band entropy", "others' entropy", "band PAR", "band PAR, highest", "val loss"], rows)}

(PAR is logged only where RAA runs; "-" for the vanilla runs.)

RAA's penalty acts on QKAI (principal-angle overlap above tau = 0.45 r); where the contraction
leaves QKAI below that, PAR is zero and RAA applies no force, whatever the stable rank does.
"""


def limits_section(r: dict[str, Any]) -> str:
    runs = r["runs"]
    counts = Counter(x["outcome"] for x in runs)
    lines = [
        f"- Of {len(runs)} runs, {counts['diverged']} diverged, {counts['spiked']} spiked and {counts['healthy']} "
        "stayed healthy by the outcome rule.",
        "- The suite's models are tiny (`instability_cpu`: 1.6 M parameters, 8 layers) and its runs short "
        "(300-600 steps on bytes; the induced collapse runs 800): "
        "instabilities that take longer, or need scale, do not show here.",
        "- Two seeds per cell: one to tune, one to test. A detector's test figures are over few runs; the "
        "counts are given next to every percentage.",
    ]
    nan = [x["name"] for x in runs if x["why"].startswith("loss nan") or x["why"].startswith("loss inf")]
    if not nan:
        lines.append("- No run's loss became NaN or infinite.")
    return "## What this does not show\n\n" + "\n".join(lines) + "\n"


# --- figures ---------------------------------------------------------------------------------------------


def lr_figure(r: dict[str, Any]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    for variant, s in r["lr_sensitivity"].items():
        lrs = sorted(s["curve"], key=float)
        fig.add_trace(
            go.Scatter(
                x=[float(x) for x in lrs],
                y=[s["curve"][x] for x in lrs],
                mode="lines+markers",
                name=f"{variant} (sensitivity {s['sensitivity']:.3f})",
            )
        )
    fig.update_xaxes(type="log", title="peak learning rate")
    fig.update_yaxes(title="final validation loss (nats, mean of 2 seeds)")
    fig.update_layout(title="Loss against learning rate", width=900, height=520)
    return fig


def bad_runs_figure(r: dict[str, Any]) -> Any:
    import plotly.graph_objects as go

    first = {x["run"].split("/")[-1]: x for x in r["test"]["runs"] + r["tune"]["runs"]}
    fig = go.Figure()
    marked = 0
    for run in (x for x in r["runs"] if x["outcome"] != "healthy"):
        steps = [p[0] for p in run["loss_curve"]]
        fig.add_trace(go.Scatter(x=steps, y=[p[1] for p in run["loss_curve"]], mode="lines", name=run["name"]))
        fired = [x["first_fire_step"] for x in first.get(run["name"], {}).get("rules", []) if x["first_fire_step"]]
        if fired:
            fig.add_vline(x=min(fired), line_dash="dot", line_color="grey")
            marked += 1
    fig.update_layout(
        title="Bad runs: loss, and the first alert of the default rules (dotted)" + ("" if marked else ": none fired"),
        width=900,
        height=520,
        xaxis_title="step",
        yaxis_title="training loss (nats)",
    )
    return fig


# --- formatting --------------------------------------------------------------------------------------------


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"
