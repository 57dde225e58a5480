"""The first part of docs/instability.md: the fair yardstick on recipes nobody tuned on (issue 40).

Every number comes from ``experiments.yardstick.results()`` (``yardstick.json``); every sentence that
judges (met, missed, default, fires or not) is computed from those numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from experiments.early_warning import detectors
from experiments.early_warning.yardstick_judging import BAR, HELDOUT_RECIPES
from experiments.early_warning.yardstick_scoring import ANY, ANY_LOSS, OLD_ALERT

FIXED = {r["name"] for r in detectors.FIXED}


def section(r: Mapping[str, Any]) -> str:
    return "\n".join(
        [
            intro(r),
            carried(r),
            judged(r),
            search(r),
            *(board(r, part) for part in HELDOUT_RECIPES),
            verdicts(r),
            qkai(r),
            board(r, "tune_seed3"),
            board(r, "tune"),
        ]
    )


def intro(r: Mapping[str, Any]) -> str:
    held = [r["parts"][p]["summary"] for p in HELDOUT_RECIPES]
    defaults = r["defaults"]
    headline = (
        f"**{', '.join(f'`{d}`' for d in defaults)} met the bar on every held-out recipe and ship as defaults.**"
        if defaults
        else "**No qkwatch rule met the bar on every held-out recipe: none ships as a default (paging).**"
    )
    base = [r["parts"][p]["rows"][r["baseline"]]["hot"] for p in HELDOUT_RECIPES]
    alarmed = " and ".join(f"{b['false_alarms']} of {b['healthy']}" for b in base)
    carries = all(b["false_alarm_rate"] is not None and b["false_alarm_rate"] <= BAR["false_alarm_rate"] for b in base)
    headline += f" The tuned loss-only baseline alarmed on {alarmed} healthy runs there: " + (
        "it carried over." if carries else "it did not carry over either (a loss level belongs to its recipe)."
    )
    return f"""# Early warnings, judged on recipes nobody tuned them on

Does an attention rule warn earlier than the loss on a recipe nobody tuned anything on? Every qkwatch
detector family and every loss-only rule a user could write were tuned the same way on one recipe
(`instability_small`, the learning-rate sweep below: its seeds 0-2), then applied unchanged to two
recipes written down before any tuning (`experiments/heldout_sweep.yml`, `qkwatch/trainer/run/recipes.py`):

* `heldout_long`: 8 layers of d_model 64 (deeper and narrower), context 512, warmup 10 % instead of
  5 %, no weight decay; {held[0]["runs"]} runs;
* `heldout_code`: 4 layers of 128, context 256, Python source code instead of English prose, **no
  warmup**, weight decay 0.3; {held[1]["runs"]} runs.

Each is a learning-rate sweep in quarter-decade steps around each variant's best rate, then
half-decade steps up to 1, over vanilla, qk_norm, sigma_reparam and raa, on seeds 10-12. Nothing is
induced. {headline}

```
python -m experiments.instability --runs experiments/heldout_sweep.yml --campaign heldout_sweep --train-only
python -m experiments.yardstick --export        # every step of the held-out runs into heldout_sweep_runs.npz
python -m experiments.yardstick --tune          # once, on the tune recipe only: yardstick_tuned.json
python -m experiments.yardstick --fix-outcome   # once, from the held-out losses alone: heldout_sweep_outcome.json
python -m experiments.instability --report      # this page and yardstick.json, from the committed files alone
```
"""


def carried(r: Mapping[str, Any]) -> str:
    """The held-out recipes side by side: every chosen rule, the tuned baseline and the earliest loss rule."""
    chosen = r["tuned"]["chosen"]
    rules = [k for k, c in chosen.items() if "rule" in c] + [ANY, r["baseline"], ANY_LOSS, OLD_ALERT]
    rows = []
    for rule in rules:
        cells = [name(r, rule)]
        for part in HELDOUT_RECIPES:
            h = r["parts"][part]["rows"][rule]["hot"]
            cells += [
                f"{h['flagged']}/{h['bad']}",
                lead(h["median_lead_steps"], None),
                lead(h["median_lead_any_loss"], None),
                f"{h['false_alarms']}/{h['healthy']}",
            ]
        rows.append(cells)
    header = ["rule"]
    for part in HELDOUT_RECIPES:
        short = part.removeprefix("heldout_")
        header += [
            f"{short}: flagged",
            f"{short}: lead over baseline",
            f"{short}: over earliest loss rule",
            f"{short}: healthy alarmed",
        ]
    return f"""## What carried over

The held-out recipes side by side, hot side (details, intervals and every other rule below): hot-side bad runs
flagged, the median lead in steps over the tuned loss-only baseline and over the earliest of the five chosen
loss rules on each run (a stricter yardstick), and the healthy runs alarmed. The bar asks, per recipe, 80 % of
the bad runs flagged, a lead of 50 steps over the baseline and at most 10 % of the healthy runs alarmed.

{table(header, rows)}
"""


def judged(r: Mapping[str, Any]) -> str:
    rows = []
    for recipe, o in r["outcomes"].items():
        rates = ", ".join(f"{v} {lr:g}" for v, lr in sorted(o["best_rates"].items()))
        rows.append([f"`{recipe}`", rates, f"{o['spread']:.4f}", f"{o['delta']:g}"])
    b = r["tuned"]["chosen"][r["baseline"]]["loss_rule"]
    return f"""## How a run is judged

Fixed before the held-out runs were trained (the header of `experiments/heldout_sweep.yml`):

* **Outcome**: diverged, spiked or degraded as in the sweep below; *degraded* is a final held-out loss
  (the mean of the last 3 evaluations) at least delta above the same variant and seed at its best
  rate in its own recipe, with delta = 3 sqrt(2) x the pooled seed-to-seed standard deviation there,
  rounded up to 0.01 nats. Each held-out recipe's best rates and delta come from its own losses
  (`heldout_sweep_outcome.json`, committed before any rule was scored on it):

{table(["recipe", "best rate per variant", "seed sd at the best rates", "delta (nats)"], rows)}

* **Hot and cold**: a run above its variant's best rate is on the hot side, below it on the cold side.
  Attention rules claim only the hot side; the cold side, under-trained runs, is the loss's job and is
  shown apart.
* **False alarms per healthy run**: any firing, at any step (initialisation and warmup included), on a
  run that ended healthy.
* **raa counted once where it is vanilla**: a raa run whose logged losses never differ from its vanilla
  twin's by 0.05 nats is not counted (on the tune recipe, every raa run at rates up to 1e-3, and none above).
* **Flagged and lead**: a bad run is flagged when a rule fires at or before its outcome's step (where the
  loss went, or the end of a degraded run). The lead is the step at which **the tuned loss-only
  baseline** first fired (the outcome's step if it had not) minus the rule's first firing. That baseline
  is `{b["text"]}`: {describe(b)}, the loss family that the same search put first (below). The lead
  over issue 31's fixed loss-only alert is shown beside it.
* **The bar**, per held-out recipe, hot side: at least {pct(BAR["flagged"])} of the bad runs flagged, a
  median lead of at least {BAR["median_lead_steps"]} steps over the tuned loss-only baseline, and at most
  {pct(BAR["false_alarm_rate"])} of the healthy runs alarmed. A rule that meets it on every held-out recipe ships
  as a default; any other stays a candidate.
"""


def describe(rule: Mapping[str, Any]) -> str:
    from qkwatch.rules.loss_rules import LossRule

    return LossRule.parse(rule["text"]).describe()


def search(r: Mapping[str, Any]) -> str:
    t = r["tuned"]
    rows = []
    for family, c in t["chosen"].items():
        rule = c.get("rule") or c["loss_rule"]
        text = rule["text"] if "text" in rule else rule_text(rule)
        pick = c["tune"]
        first = "-" if pick["median_first_firing"] is None else f"{pick['median_first_firing']:g}"
        kind = (
            "loss only" + (" (**the baseline**)" if family == r["baseline"] else "") if "loss_rule" in c else "qkwatch"
        )
        rows.append([f"`{family}`", kind, f"`{text}`", f"{pick['flagged']}/{pick['bad']}", first, c["of"]])
    unchosen = ", ".join(f"`{f}`" for f in t["unchosen"]) or "none"
    return f"""## The search on the tune recipe

One criterion for every family (`experiments/early_warning/rule_search.py`), on the tune recipe's seeds 0-2
({t["hot_bad"]} hot-side bad runs, {t["healthy"]} healthy, {len(t["twins"])} raa runs counted as their vanilla
twins): only candidates with no alarm on any healthy run compete; among those flagging at least 80 % of
the hot-side bad runs, the earliest median first firing wins; when none does, the one that flags most.
Grids are fine on both sides (thresholds in steps of 0.01 or 0.005, loss levels in steps of 0.025 nats).
Families where every candidate alarmed on a healthy tune run, so nothing was chosen: {unchosen}.

{table(["family", "kind", "chosen", "hot bad flagged (tune)", "median first firing (step)", "candidates"], rows)}
"""


def board(r: Mapping[str, Any], part: str) -> str:
    p = r["parts"][part]
    s = p["summary"]
    labels = ", ".join(f"{n} {k}" for k, n in s["labels"].items())
    rows = []
    for rule, row in p["rows"].items():
        h = row["hot"]
        rows.append(
            [
                name(r, rule),
                frac(h["flagged"], h["bad"], h["flagged_interval"]),
                lead(h["median_lead_steps"], h["lead_interval"]),
                lead(h["median_lead_any_loss"], None),
                lead(h["median_lead_old_alert"], None),
                frac(h["false_alarms"], h["healthy"], h["false_alarm_interval"]),
                bar(r, rule, row),
            ]
        )
    cold = [
        [name(r, rule), f"{row['cold']['flagged']}/{row['cold']['bad']}", lead(row["cold"]["median_lead_steps"], None)]
        for rule, row in p["rows"].items()
    ]
    qk = "-" if s["qkai_max"] is None else f"{s['qkai_max']:.3f}"
    return f"""## {p["label"]}

{s["runs"]} runs, {s["counted"]} counted ({s["twins"]} raa {"run" if s["twins"] == 1 else "runs"} counted as {"its vanilla twin" if s["twins"] == 1 else "their vanilla twins"}): {labels};
{s["hot_bad"]} bad on the hot side, {s["cold_bad"]} on the cold side, {s["healthy"]} healthy. Largest QKAI
of any run, layer and report: {qk}. Intervals: 95 % (Wilson for shares, bootstrap for medians).

**Hot side** (rates above the variant's best):

{table(["rule", "hot bad runs flagged", "median lead over the tuned loss baseline (steps)", "over the earliest chosen loss rule", "over issue 31's loss alert", "healthy runs alarmed", "bar"], rows)}

<details><summary>Cold side (under-trained runs: the loss's job)</summary>

{table(["rule", "cold bad runs flagged", "median lead over the tuned loss baseline"], cold)}

</details>
"""


def verdicts(r: Mapping[str, Any]) -> str:
    lines = [
        "## Defaults from the evidence\n",
        "Every qkwatch rule above against the bar on each held-out recipe (hot side), and what it missed by how much:\n",
    ]
    first = r["parts"][HELDOUT_RECIPES[0]]["rows"]
    for rule in [k for k in first if not baseline_row(r, k)]:
        per = []
        for part in HELDOUT_RECIPES:
            v = r["parts"][part]["rows"][rule]["bar"]
            per.append(f"{part}: {'met' if v['met'] else 'missed (' + '; '.join(v['missed']) + ')'}")
        if rule in FIXED:
            status = "stays what it is, the built-in collapse rule (never tuned; it speaks of QKAI above 0.70)"
        else:
            status = "**ships as a default**" if rule in r["defaults"] else "stays a candidate"
        lines.append(f"* `{rule}` {status}. {'; '.join(per)}.")
    return "\n".join(lines) + "\n"


def qkai(r: Mapping[str, Any]) -> str:
    rows = []
    for part in ("tune", "tune_seed3", *HELDOUT_RECIPES):
        p = r["parts"][part]
        fired = p["rows"]["qkai_high"]
        n = fired["hot"]["flagged"] + fired["hot"]["false_alarms"]
        rows.append([p["label"], "-" if p["summary"]["qkai_max"] is None else f"{p['summary']['qkai_max']:.3f}", n])
    crossed = [row for row in rows if row[1] != "-" and float(row[1]) > r["collapse_threshold"]]
    says = (
        f"QKAI > {r['collapse_threshold']:g} was reached without induction in: {', '.join(row[0] for row in crossed)}."
        if crossed
        else f"**QKAI > {r['collapse_threshold']:g} never happened without induction**, on any recipe: the "
        "collapse rules (`qkai_high`, `collapse_band`) fired on no run here, so they are scored only on the "
        "induced band (the demo's)."
    )
    return f"""## QKAI on its own

{says}

{table(["runs", "largest QKAI (any run, layer, report)", "runs qkai_high fired on (hot bad or healthy)"], rows)}
"""


def name(r: Mapping[str, Any], rule: str) -> str:
    chosen = r["tuned"]["chosen"]
    if rule == r["baseline"]:
        return f"`{rule}` (loss only; **the baseline**)"
    if rule in chosen and "loss_rule" in chosen[rule]:
        return f"`{rule}` (loss only)"
    if rule in (OLD_ALERT, ANY_LOSS) or rule.startswith("rate >="):
        return f"{rule} (baseline)"
    return f"`{rule}`"


def bar(r: Mapping[str, Any], rule: str, row: Mapping[str, Any]) -> str:
    if baseline_row(r, rule):
        return "-"
    return "met" if row["bar"]["met"] else "missed: " + "; ".join(row["bar"]["missed"])


def baseline_row(r: Mapping[str, Any], rule: str) -> bool:
    """A loss-only rule or another baseline (not a qkwatch detector)."""
    chosen = r["tuned"]["chosen"]
    return (
        (rule in chosen and "loss_rule" in chosen[rule]) or rule in (OLD_ALERT, ANY_LOSS) or rule.startswith("rate >=")
    )


def frac(k: int, n: int, interval: Sequence[float] | None) -> str:
    if not n:
        return "-"
    ci = f" [{100 * interval[0]:.0f}-{100 * interval[1]:.0f} %]" if interval else ""
    return f"{k}/{n} ({100 * k / n:.0f} %{ci})"


def lead(x: float | None, interval: Sequence[float] | None) -> str:
    if x is None:
        return "-"
    return f"{x:g}" + (f" [{interval[0]:g}, {interval[1]:g}]" if interval else "")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def rule_text(rule: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in rule.items() if k != "name")
