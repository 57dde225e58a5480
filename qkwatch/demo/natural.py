"""``qkwatch demo --natural``: trouble nobody designed, live: a hot learning rate beside its safe twin.

Four runs of ``instability_small`` (6 layers of 96, 800 steps, byte-level text; nothing induced) into
one collector, which judges them with the candidate detectors (``qkwatch/dashboards/rules/detectors.yml``):

* ``vanilla-hot``, vanilla attention at lr 0.03, and ``vanilla-safe`` at lr 0.003, its twin (the
  same seed, data and model): in the run recorded in ``experiments/results/demo_natural.txt`` the hot
  run's largest attention logit was 176 and its attention entropy 0.04 at step 50, while its loss
  looked like a slower run's, and it ended 0.99 nats worse;
* ``qk_norm-hot``: qk_norm at the hot rate, which bounds the logits (Wortsman et al. 2023);
* ``raa-hot``: RAA at the hot rate. RAA anchors the rank of the query-key map; it does not bound the
  logits' growth, and at this rate it did not help (0.73 nats worse): the demo shows it as it is.

The closing tables, read back from the collector: each run's final held-out loss (the mean of its
last 3 evaluations) against the safe twin's, the first alert to fire and its step, and the step at
which a loss-only alert on the run's own loss would have said anything (the one the instability
suite tuned, ``qkwatch.rules.loss_rules.TUNED_BASELINE``); then, per rule, the step it first fired
on each run (a firing, not the onset of its condition), and what fired on the twin that ended well.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkwatch.demo.runs import DEFAULT_PORT, PROGRESS_SECONDS, PROJECT, Trainee, commands, shown, start_run

if TYPE_CHECKING:
    from qkwatch.client.backtest import Firing
    from qkwatch.client.rest import Client

RECIPE = "instability_small"
HOT, SAFE = 0.03, 0.003
RUNS: dict[str, list[str]] = {
    "vanilla-hot": [f"optim.lr={HOT}"],
    "vanilla-safe": [f"optim.lr={SAFE}"],
    "qk_norm-hot": [f"optim.lr={HOT}", "model.variant=qk_norm"],
    "raa-hot": [f"optim.lr={HOT}", "raa.enabled=true"],
}
"""The runs and what makes them differ (the same seed, 0, for all)."""
TWIN = "vanilla-safe"
NOT_SHOWN = (
    "Nothing here is induced. What the demo does not show: how often the attention signal leads the loss, "
    "and whether any rule is good enough to page on; one seed of one rate cannot say. That is the scoreboard "
    "on recipes nothing was tuned on, where no rule was (docs/instability.md)."
)


def detectors() -> Path:
    """The candidate detectors' rules file, shipped inside the package."""
    import qkwatch.dashboards

    return Path(qkwatch.dashboards.__file__).parent / "rules" / "detectors.yml"


def run_natural(args: argparse.Namespace) -> int:
    from qkwatch.launch import CollectorLaunchError, CollectorProcess, first_free_port

    workdir = Path(args.dir).resolve() / "natural"
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    port = args.port or first_free_port(DEFAULT_PORT)
    collector = CollectorProcess(
        f"sqlite:///{workdir / 'collector.db'}",
        port=port,
        log=workdir / "collector.log",
        args=("--rules", str(detectors())),
    )
    trainees: list[Trainee] = []
    try:
        try:
            collector.start()
        except CollectorLaunchError:
            print(f"qkwatch demo: the collector did not start; see {workdir / 'collector.log'}", file=sys.stderr)
            return 1
        with collector.client(timeout=10.0) as client:
            names = natural_names(client)
            for run, sets in RUNS.items():
                trainees.append(start_run(run, names[run], RECIPE, [*args.set, *sets], collector.url, workdir))
            print(
                f"\nqkwatch demo --natural: {RECIPE} four times into {collector.url}, nothing induced\n"
                f"  vanilla at lr {HOT:g} beside its twin at {SAFE:g}; qk_norm and RAA at {HOT:g}; candidate rules "
                f"from {detectors().name}; logs in {workdir}",
                flush=True,
            )
            _follow(client, trainees)
            failed = [t for t in trainees if t.process.returncode != 0]
            for t in failed:
                print(f"qkwatch demo: {t.variant} failed (exit {t.process.returncode}); see {t.log}", file=sys.stderr)
            if not failed:
                print(natural_table(client, {t.variant: _run_id(client, t) for t in trainees}), flush=True)
                print(NOT_SHOWN, flush=True)
            if failed:
                return 1
            if args.no_serve:
                print("\nthe collector stops now (--no-serve)", flush=True)
                return 0
            print(serving(collector.url, {t.variant: _run_id(client, t) for t in trainees}, workdir), flush=True)
        collector.wait()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for t in trainees:
            if t.process.poll() is None:
                t.process.send_signal(signal.SIGTERM)
                t.process.wait(timeout=60)
        collector.stop()


def serving(url: str, run_ids: dict[str, str], workdir: Path) -> str:
    """What the demo prints while it serves: the live page on the logits, and the report of the hot run
    beside its twin, each as it runs from here."""
    from qkwatch.client.rest import DEFAULT_URL

    default = url == DEFAULT_URL and os.environ.get("QKWATCH_URL", DEFAULT_URL) == DEFAULT_URL
    at = "" if default else f" --url {url}"
    qkwatch, _ = commands()
    page = f"{url}/?" + "&".join(f"run={run_id}" for run_id in run_ids.values()) + "&metric=logit_max"
    hot, twin = run_ids["vanilla-hot"], run_ids[TWIN]
    return "\n".join(
        [
            f"\nthe collector keeps serving the four runs at {url} until Ctrl-C; from this directory:",
            f"  live page (largest attention logit per layer; pick attn_entropy too):  {page}",
            f"  {qkwatch} report {hot} --vs {twin} --out {shown(workdir / 'report.html')}{at}",
        ]
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def natural_names(client: Client) -> dict[str, str]:
    """``natural-<run>``, or ``natural-<run>-2``, ``-3``... beside earlier ones in the same database."""
    n = 1
    while True:
        names = {run: f"natural-{run}" if n == 1 else f"natural-{run}-{n}" for run in RUNS}
        if not any(client.runs(project=PROJECT, name=name)["count"] for name in names.values()):
            return names
        n += 1


def _run_id(client: Client, t: Trainee) -> str:
    """The run's id once the trainee has registered it; "" before (and asked again next time)."""
    if not t.run_id:
        found = client.runs(project=PROJECT, name=t.name)["data"]
        t.run_id = found[0]["id"] if found else None
    return t.run_id or ""


def _follow(client: Client, trainees: list[Trainee]) -> None:
    from qkwatch.client.rest import CollectorError

    last = 0.0
    while any(t.process.poll() is None for t in trainees):
        time.sleep(0.5)
        if time.monotonic() - last < PROGRESS_SECONDS:
            continue
        last = time.monotonic()
        try:
            print("  " + " | ".join(progress(client, t.variant, _run_id(client, t)) for t in trainees), flush=True)
        except CollectorError:
            continue


def progress(client: Client, run: str, run_id: str) -> str:
    """``run @ step: logit X, entropy Y [rules firing]``: the largest logit and the lowest entropy
    over the layers at the run's latest measured step."""
    if not run_id or "logit_max" not in client.metrics(run_id).metrics:
        return f"{run}: starting"
    logits, entropy = (client.heatmap(run_id, m, max_steps=20_000) for m in ("logit_max", "attn_entropy"))
    firing = sorted({a["rule"] for a in client.alerts(run=run_id, state="firing")["data"]})
    alert = f" [{','.join(firing)}]" if firing else ""
    return (
        f"{run} @ {logits['steps'][-1]}: logit {_extreme(logits['values'][-1], max):.0f}, "
        f"entropy {_extreme(entropy['values'][-1], min):.2f}{alert}"
    )


def _extreme(row: list[Any], pick: Any) -> float:
    values = [v for v in row if isinstance(v, (int, float))]
    return float(pick(values)) if values else float("nan")


def natural_table(client: Client, runs: dict[str, str]) -> str:
    """The closing tables, every figure read back from the collector: per run, where it ended, its first
    alert and the step a loss-only alert would have spoken; per rule, the step it first fired on each run
    (the collector's own evaluator replaying the stored reports: the firing, not the onset)."""
    from qkwatch.client import backtest, run_history
    from qkwatch.client.outcomes import final_heldout
    from qkwatch.rules.loss_rules import TUNED_BASELINE
    from qkwatch.rules.ruleset import RuleSet

    rules = RuleSet.from_file(detectors(), client.collapse_threshold())
    histories = {run: run_history.read(client, run_id) for run, run_id in runs.items()}
    fired = {run: first_firings(backtest.replay(rules, h.reports)) for run, h in histories.items()}
    finals = {run: final_heldout(h.val_losses, 3) for run, h in histories.items()}
    rows = []
    for run, h in histories.items():
        loss = TUNED_BASELINE.first_firing(h.loss_steps, h.losses, h.loss_steps[-1] + 1) if h.losses else None
        first = min(fired[run].items(), key=lambda kv: (kv[1], kv[0]), default=None)
        lmax = client.heatmap(runs[run], "logit_max", max_steps=20_000)
        peak = max((_extreme(row, max) for row in lmax["values"]), default=float("nan"))
        rows.append(
            [
                run,
                f"{finals[run]:.3f}",
                "(twin)" if run == TWIN else f"{finals[run] - finals[TWIN]:+.3f}",
                f"{first[0]} @ {first[1]}" if first else "none",
                str(loss) if loss is not None else "never",
                f"{peak:.0f}",
            ]
        )
    header = ["run", "final held-out loss", "vs safe twin", "first alert fired", "loss-only alert at", "largest logit"]
    names = backtest.rule_names(rules)
    by_rule = [[rule, *(str(fired[run].get(rule, "-")) for run in runs)] for rule in names]
    twin = ", ".join(f"{rule} @ {step}" for rule, step in sorted(fired[TWIN].items(), key=lambda kv: kv[1]))
    twin = f"every firing on it is a false alarm: {twin}" if twin else "nothing fired on it"
    twin = f"on the safe twin (lr {SAFE:g}, the sweep's best rate for vanilla: a run that ends well) {twin}"
    return "\n".join(
        [
            "",
            _columns([header, *rows]),
            f"  loss-only alert: {TUNED_BASELINE.describe()} (the instability suite's tuned one; issue 40)",
            "",
            _columns([["first fired at step", *runs], *by_rule]),
            f"  {twin}",
        ]
    )


def first_firings(firings: list[Firing]) -> dict[str, int]:
    """Rule -> the step of its first firing (the report at which it fired, not where its condition began)."""
    out: dict[str, int] = {}
    for f in sorted(firings, key=lambda f: (f.attempt, f.step)):
        out.setdefault(f.rule, f.step)
    return out


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
