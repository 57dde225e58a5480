"""Issue 40's yardstick: judging, the one search criterion and the scores, on runs whose answers are known by
construction; the search's numpy replica against the collector's own evaluator on committed runs; and the
constants the product ships against the committed results they come from."""

from __future__ import annotations

import json
import math
import random

import pytest

from experiments import yardstick
from experiments.early_warning import rule_search, yardstick_judging, yardstick_scoring
from experiments.early_warning.instability_data import RunRecord
from experiments.early_warning.rule_search import Pick, choose, criterion_key
from experiments.early_warning.yardstick_judging import Judged, Run, coincide, fix_outcome, judge_runs
from experiments.early_warning.yardstick_scoring import score, wilson
from qkwatch.client import outcomes
from qkwatch.client.run_history import RunHistory
from qkwatch.commands import backtest as cli_backtest
from qkwatch.rules.loss_rules import TUNED_BASELINE


def record(name: str, final: float, bump: float = 0.0) -> RunRecord:
    losses = [1.5 + 4.0 * math.exp(-i / 300) + bump for i in range(600)]
    return RunRecord(
        name, RunHistory(name, [], list(range(600)), losses), [199, 399, 499, 599], [3, final, final, final]
    )


def recipe() -> tuple[list[Run], dict[str, RunRecord]]:
    """vanilla and raa at 1e-3 / 3e-3 / 1e-2, seeds 10 and 11. vanilla's best is 3e-3 (finals 1.50, 1.52);
    1e-2 ends 0.3 worse on seed 10; 1e-3 is within delta. raa equals vanilla to 0.01 nats at 1e-3, and
    differs by 0.2 at 1e-2 (so it is counted there)."""
    runs, records = [], {}
    finals = {
        (1e-3, 10): 1.55,
        (1e-3, 11): 1.56,
        (3e-3, 10): 1.50,
        (3e-3, 11): 1.52,
        (1e-2, 10): 1.80,
        (1e-2, 11): 1.53,
    }
    for variant in ("vanilla", "raa"):
        for (lr, seed), final in finals.items():
            name = f"r-{variant}-{lr:g}-s{seed}"
            runs.append(Run(name, "r", variant, lr, seed))
            bump = 0.0 if variant == "vanilla" else 0.01 if lr < 1e-2 else 0.2
            records[name] = record(name, final, bump)
    return runs, records


def test_each_recipe_gets_its_best_rates_and_delta_from_its_own_losses() -> None:
    runs, records = recipe()
    fixed = fix_outcome(runs, records)["recipes"]["r"]
    assert fixed["best_rates"] == {"raa": 3e-3, "vanilla": 3e-3}
    # two groups of two, each with a difference of 0.02: pooled sd 0.02 / sqrt(2); delta 3 sqrt(2) sd = 0.06
    assert fixed["spread"] == pytest.approx(0.02 / math.sqrt(2)) and fixed["delta"] == pytest.approx(0.06)


def test_runs_are_judged_with_their_side_and_raa_counts_once_where_it_is_vanilla() -> None:
    runs, records = recipe()
    judged = {j.run.name: j for j in judge_runs(runs, records, fix_outcome(runs, records)["recipes"])}
    hot = judged["r-vanilla-0.01-s10"]
    assert (hot.label, hot.side, hot.outcome_step, hot.bad) == ("degraded", "hot", 599, True)
    assert (judged["r-vanilla-0.01-s11"].label, judged["r-vanilla-0.001-s10"].side) == ("healthy", "cold")
    assert judged["r-vanilla-0.003-s10"].side == "best" and judged["r-vanilla-0.003-s10"].reference is None
    # raa at 1e-3 and 3e-3 is vanilla plus 0.01 nats: counted once; at 1e-2 it differs by 0.2: counted
    assert judged["r-raa-0.001-s10"].twin == "r-vanilla-0.001-s10" and judged["r-raa-0.01-s10"].twin is None
    assert len(yardstick_judging.counted(list(judged.values()))) == 12 - 4


def test_coincide_is_strictly_under_the_tolerance() -> None:
    a = record("a", 1.5)
    assert coincide(a, record("b", 1.5, bump=0.0499)) and not coincide(a, record("c", 1.5, bump=0.05))
    broken = record("d", 1.5)
    broken.history.losses[5] = math.nan  # type: ignore[index]
    assert not coincide(a, broken)


def judged_run(name: str, label: str, side: str, step: int = 599) -> Judged:
    return Judged(Run(name, "r", "vanilla", 0.1, 0), record(name, 1.5), 1.5, None, label, step, side, 600)


def test_score_counts_flags_before_the_outcome_leads_over_the_baseline_and_alarms_per_healthy_run() -> None:
    part = [
        judged_run("a", "degraded", "hot"),
        judged_run("b", "degraded", "hot"),
        judged_run("c", "diverged", "hot", step=100),
        judged_run("d", "degraded", "cold"),
        judged_run("ok1", "healthy", "best"),
        judged_run("ok2", "healthy", "hot"),
    ]
    fired = {"a": 50, "b": 400, "c": 150, "ok2": 0}  # c fires after its divergence: not flagged
    baseline = {"a": 300, "c": 90}  # b: the baseline never fired, so the user learned at the end (599)
    s = score(part, "hot", fired, baseline, {"a": 10})
    assert (s["bad"], s["flagged"], s["leads"]) == (3, 2, [199, 250])  # 599 - 400, 300 - 50
    assert s["median_lead_old_alert"] == pytest.approx(((10 - 50) + (599 - 400)) / 2)
    assert (s["healthy"], s["false_alarms"], s["false_alarm_rate"]) == (2, 1, 0.5)
    assert s["false_alarm_runs"] == ["ok2"] and s["false_alarm_steps"] == [0]  # at initialisation too
    assert yardstick_scoring.verdict(s) == {
        "met": False,
        "missed": ["flagged 2/3, needs 3", "1/2 healthy runs alarmed, at most 0 allowed"],
    }


def test_wilson_interval_matches_its_closed_form() -> None:
    z2 = 1.96**2
    assert wilson(0, 10) == pytest.approx([0.0, z2 / (10 + z2)])  # upper bound of 0/n: z^2 / (n + z^2)
    assert wilson(10, 10) == pytest.approx([10 / (10 + z2), 1.0])
    assert wilson(0, 0) is None
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(1 - hi) and lo == pytest.approx(0.2366, abs=1e-4)


def test_the_criterion_prefers_the_earliest_rule_that_still_catches_most() -> None:
    bad = {f"b{i}": 500 for i in range(10)}
    healthy = ["h1", "h2"]
    late_all = {f"b{i}": 300 for i in range(10)}  # flags 10, at 300
    early_most = {f"b{i}": 50 for i in range(8)}  # flags 8 (80 %), at 50
    early_few = {f"b{i}": 10 for i in range(5)}  # flags 5: below 80 %
    alarming = {**{f"b{i}": 5 for i in range(10)}, "h1": 0}  # alarms on a healthy run: out
    pick = choose("f", [late_all, early_most, early_few, alarming], bad, healthy)
    assert pick is not None and pick.index == 1 and pick.median_first_firing == 50
    # none reaches 80 %: the one that flags most, then the earlier
    pick = choose("f", [early_few, {f"b{i}": 400 for i in range(6)}, {f"b{i}": 200 for i in range(6)}], bad, healthy)
    assert pick is not None and pick.index == 2
    assert choose("f", [alarming, {}], bad, healthy) is None
    assert criterion_key(Pick("f", 0, 8, 10, 0, 2, 50)) < criterion_key(Pick("f", 1, 10, 10, 0, 2, 300))


def test_the_replica_is_the_collectors_evaluator_on_committed_runs() -> None:
    """Forty random candidates of every detector family on twelve committed runs of the tune recipe."""
    runs = [r for r in yardstick.suite_runs(yardstick.TUNE_SUITE) if r.seed == 0 and r.lr in (3e-3, 3e-2, 0.3)]
    judged = judge_runs(runs, yardstick.load_records(yardstick.TUNE_DATA, runs), yardstick.outcomes())
    rng = random.Random(40)
    candidates = [
        {"name": f"{family}_{i}", **c}
        for family, pool in rule_search.DETECTOR_FAMILIES.items()
        for i, c in enumerate(rng.sample(pool, 6))
    ]
    replayed = yardstick_judging.replayed(candidates, judged, 0.7)
    mine = yardstick_judging.detector_firings([{k: v for k, v in c.items() if k != "name"} for c in candidates], judged)
    assert [m for m in mine] == [replayed[c["name"]] for c in candidates]
    assert sum(len(m) for m in mine) > 40  # the candidates do fire: the comparison is not of empty maps


def test_what_the_product_ships_is_what_the_committed_results_say() -> None:
    tuned = json.loads(yardstick.TUNED.read_text())
    assert TUNED_BASELINE.to_json() == tuned["chosen"][tuned["baseline"]]["loss_rule"]
    assert cli_backtest.TUNED_BASELINE.text() == TUNED_BASELINE.text()
    fixed = json.loads(yardstick.TUNE_OUTCOME.read_text())
    assert outcomes.SUITE_DELTA == fixed["delta"] == cli_backtest.SUITE_DELTA


@pytest.mark.slow
def test_the_search_on_the_committed_tune_runs_gives_the_committed_choice() -> None:
    assert json.loads(json.dumps(yardstick_judging.tune(yardstick.tune_runs_judged()))) == json.loads(
        yardstick.TUNED.read_text()
    )
