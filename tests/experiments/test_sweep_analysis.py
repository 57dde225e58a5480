"""The sweep's judging and scoring on runs whose answers are known by construction."""

from __future__ import annotations

import math

import pytest

from experiments.early_warning.instability_data import RunRecord
from experiments.early_warning.sweep_scoring import (
    Judged,
    Sweep,
    best_rates,
    choose_lr_threshold,
    fix_outcome,
    judge_runs,
    loss_alert_firings,
    lr_firings,
    meets_bar,
    score,
)
from qkwatch.client.outcomes import Outcome
from qkwatch.client.run_history import RunHistory


def falling(n: int = 800, end: float = 1.5) -> list[float]:
    """Still falling by 0.15 nats per 100 steps at step 600: the loss-only alert stays quiet."""
    return [end + 4.0 * math.exp(-i / 300) for i in range(n)]


def record(name: str, losses: list[float], val: list[float]) -> RunRecord:
    steps = list(range(len(losses)))
    return RunRecord(name, RunHistory(name, [], steps, losses), [49 + 50 * i for i in range(len(val))], val)


def sweep() -> tuple[list[Sweep], dict[str, RunRecord]]:
    """One variant, rates 1e-3 / 3e-3 / 1e-2, seeds 0 (tune) and 1 (test). 3e-3 is best (final 1.50
    and 1.52); 1e-2 ends 0.3 worse on seed 0 and 0.01 worse on seed 1; 1e-3 is healthy."""
    runs, records = [], {}
    finals = {(1e-3, 0): 1.55, (1e-3, 1): 1.56, (3e-3, 0): 1.50, (3e-3, 1): 1.52, (1e-2, 0): 1.80, (1e-2, 1): 1.53}
    for (lr, seed), final in finals.items():
        name = f"lr-v-{lr:g}-s{seed}"
        runs.append(Sweep(name, "v", lr, seed, "tune" if seed == 0 else "test"))
        records[name] = record(name, falling(end=final - 0.2), [3.0, 2.0, final, final, final])
    return runs, records


def test_the_best_rate_and_delta_come_from_the_seeds_at_it() -> None:
    runs, records = sweep()
    fixed = fix_outcome(runs, records)
    assert fixed["best_rates"] == {"v": 3e-3}
    assert fixed["finals_at_best"] == {"v": [pytest.approx(1.50), pytest.approx(1.52)]}
    # one group of two: sd = 0.02 / sqrt(2) = 0.01414; 3 sqrt(2) x 0.01414 = 0.06, exactly (rounding up to 0.06)
    assert fixed["spread"] == pytest.approx(0.02 / math.sqrt(2))
    assert fixed["delta"] == pytest.approx(0.06)


def test_runs_are_judged_against_their_own_seed_at_the_best_rate() -> None:
    runs, records = sweep()
    judged = {j.run.name: j for j in judge_runs(runs, records, fix_outcome(runs, records))}
    assert judged["lr-v-0.01-s0"].outcome.label == "degraded"  # 1.80 >= 1.50 + 0.06
    assert judged["lr-v-0.01-s0"].reference == pytest.approx(1.50)
    assert judged["lr-v-0.01-s1"].outcome.label == "healthy"  # 1.53 < 1.52 + 0.06
    assert judged["lr-v-0.003-s0"].reference is None and judged["lr-v-0.003-s0"].outcome.label == "healthy"
    assert judged["lr-v-0.01-s0"].visible is None  # the loss alone never shows it ...
    assert judged["lr-v-0.01-s0"].outcome.step == 799  # ... so a loss-only user learns at the end


def _j(name: str, lr: float, label: str, visible: int | None, total: int = 800) -> Judged:
    rec = record(name, falling(total), [1.5])
    return Judged(Sweep(name, "v", lr, 0, "tune"), rec, 1.5, 1.5, Outcome(label, None, ""), visible, total)  # type: ignore[arg-type]


def test_scores_count_leads_against_the_loss_and_false_alarms_on_healthy_runs() -> None:
    judged = [
        _j("a", 0.3, "degraded", 300),
        _j("b", 1.0, "diverged", 100),
        _j("c", 1e-4, "degraded", None),  # the loss never showed it: known at the end, step 799
        _j("d", 3e-3, "healthy", None),
        _j("e", 1e-2, "healthy", 500),  # the loss-only alert fires on a healthy run: its false alarm
    ]
    s = score(judged, {"a": 50, "b": 150, "c": 199, "d": 10})
    assert s["bad"] == 3 and s["flagged"] == 3 and s["leads"] == [-50, 250, 600]
    assert s["median_lead_steps"] == 250 and s["false_alarms"] == 1 and s["false_alarm_runs"] == ["d"]
    assert s["false_alarm_rate"] == pytest.approx(0.2) and not meets_bar(s)
    loss_only = score(judged, loss_alert_firings(judged))
    assert loss_only["flagged"] == 2 and loss_only["leads"] == [0, 0] and loss_only["false_alarm_runs"] == ["e"]
    x = choose_lr_threshold(judged)
    assert x == 0.3  # the smallest rate above every healthy run's (1e-2)
    by_lr = score(judged, lr_firings(judged, x))
    assert by_lr["flagged"] == 2 and by_lr["leads"] == [100, 300] and by_lr["false_alarms"] == 0
    good = score(judged[:4] + [_j(f"h{i}", 3e-3, "healthy", None) for i in range(6)], {"a": 50, "b": 10, "c": 100})
    assert meets_bar(good)  # 3 of 3 flagged, median lead 250, no false alarm in 10


def test_best_rates_skip_a_rate_that_did_not_end_finite() -> None:
    runs = [Sweep("x", "v", 0.1, 0, "tune"), Sweep("y", "v", 0.01, 0, "tune")]
    assert best_rates(runs, {"x": math.inf, "y": 2.0}) == {"v": 0.01}


def synthetic_board() -> dict:
    """Rates 3e-3 (best) and 0.3 over seeds 0 (tune), 1 (test), 2 (held out). At 0.3 each run ends
    0.5 worse, and its metric ``x`` crosses 1.0 at step 200 (the loss never shows it: known at 799);
    the best-rate runs keep ``x`` at 0.5. The candidate threshold 1.0 is chosen (2.0 never fires);
    the shipped rule ``x_low`` (x > 0.4) fires on every run."""
    from experiments.early_warning.sweep_scoring import scoreboard
    from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD
    from qkwatch.rules.ruleset import RuleSet
    from qkwatch.rules.transitions import ReportValues

    runs, records = [], {}
    for lr in (3e-3, 0.3):
        for seed, split in ((0, "tune"), (1, "test"), (2, "holdout")):
            name = f"lr-v-{lr:g}-s{seed}"
            final = 1.5 + 0.001 * seed + (0.5 if lr == 0.3 else 0.0)
            reports = [
                ReportValues(1, step, {"x": [1.5 if (lr == 0.3 and step >= 200) else 0.5]})
                for step in range(0, 800, 10)
            ]
            losses = falling(end=final - 0.2)
            records[name] = RunRecord(
                name, RunHistory(name, reports, list(range(800)), losses), [749, 799], [final, final]
            )
            runs.append(Sweep(name, "v", lr, seed, split))
    fixed = {
        "k": 2,
        "best_rates": {"v": 3e-3},
        "finals_at_best": {"v": [1.5, 1.501]},
        "spread": 0.001,
        "delta": 0.1,
        "rule": "chosen by hand for the test",
    }
    families = {"x_high": [{"metric": "x", "op": ">", "threshold": t, "for_reports": 1} for t in (2.0, 1.0)]}
    shipped = [{"name": "x_low", "metric": "x", "op": ">", "threshold": 0.4, "for_reports": 1}]
    return scoreboard(
        runs,
        records,
        fixed,
        families,
        [],
        lambda r: RuleSet.from_mapping({"rules": r}, COLLAPSE_THRESHOLD),
        shipped,
    )


def test_the_scoreboard_chooses_on_tune_and_scores_every_split_beside_the_baselines() -> None:
    board = synthetic_board()
    assert board["chosen"]["x_high"]["rule"]["threshold"] == 1.0
    assert board["lr_threshold"] == 0.3
    held = board["tables"]["holdout"]
    assert (
        held["x_high"]["flagged"] == 1
        and held["x_high"]["leads"] == [799 - 200]
        and held["x_high"]["false_alarms"] == 0
    )
    assert held["any chosen or collapse rule"]["flagged"] == 1
    assert held["any chosen or collapse rule"]["false_alarms"] == 0  # the untuned shipped rule is not in it
    as_shipped = held["detectors.yml:x_low"]
    assert as_shipped["leads"] == [799] and as_shipped["false_alarm_runs"] == ["lr-v-0.003-s2"]
    assert not as_shipped["baseline"] and not as_shipped["meets_bar"] and not as_shipped["default"]
    # x_high ties the rate baseline (1 of 1 flagged, no false alarm): it meets the bar, yet is no default
    assert held["x_high"]["meets_bar"] and not held["x_high"]["beats_baselines"] and not held["x_high"]["default"]
    assert held["x_high"]["beats_baselines"] is False and held["loss-only alert"]["beats_baselines"] is False
    peaks = {r["name"]: r["peaks"] for r in board["runs"]}
    assert peaks["lr-v-0.3-s1"] == {"logit_max": None, "qkai": None, "attn_entropy": None, "stable_rank": None}
    assert held["loss-only alert"]["flagged"] == 0  # the loss never showed the degradation
    assert held["lr >= 0.3"]["leads"] == [799] and held["lr >= 0.3"]["baseline"]
    outcomes = {r["name"]: r["outcome"] for r in board["runs"]}
    assert outcomes["lr-v-0.3-s2"] == "degraded" and outcomes["lr-v-0.003-s2"] == "healthy"
    assert board["lr_sensitivity"]["v"]["per_seed"][0] == pytest.approx(0.25)  # (0 + 0.5) / 2 rates


def test_beating_a_baseline_means_more_flagged_for_no_more_false_alarms_or_fewer_for_as_many() -> None:
    from experiments.early_warning.sweep_scoring import beats

    base = {"flagged": 3, "false_alarms": 1}
    assert beats({"flagged": 4, "false_alarms": 1}, base) and beats({"flagged": 3, "false_alarms": 0}, base)
    assert not beats({"flagged": 3, "false_alarms": 1}, base)  # a tie
    assert not beats({"flagged": 5, "false_alarms": 2}, base)  # more flagged, but more false alarms


def test_the_sweep_goes_on_from_the_committed_file_on_another_machine(tmp_path, monkeypatch) -> None:
    """Runs the per-step file holds are not trained again; scoring a file that lacks runs stops, naming them."""
    import pytest

    from experiments import instability, sweep_analysis
    from experiments.early_warning import instability_data
    from experiments.suite import load_runs

    suite = load_runs(sweep_analysis.SUITE)
    kept = suite[5].name
    path = instability_data.save([record(kept, falling(), [2.0])], tmp_path / "runs.npz")
    monkeypatch.setattr(sweep_analysis, "data_path", lambda: path)
    trained: list[str] = []
    monkeypatch.setattr(instability, "train", lambda opts, todo: trained.extend(r.name for r in todo))
    opts = instability.parse(["--runs", str(sweep_analysis.SUITE), "--train-only"])
    assert instability.sweep_main(opts, suite) == 0
    assert trained == [r.name for r in suite if r.name != kept]

    runs, records = sweep()
    with pytest.raises(SystemExit, match=r"lacks 1 of them \(e\.g\. " + runs[1].name):
        sweep_analysis.complete(runs[:2], {runs[0].name: records[runs[0].name]}, "the scoreboard")
    sweep_analysis.complete(runs[:1], records, "the scoreboard")
