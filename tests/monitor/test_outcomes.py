"""The outcome rule on losses whose label is known by construction.

``RAW`` (no smoothing) checks the excursion logic step by step; the default rule smooths with a
trailing mean of 20, checked on its own below.
"""

from __future__ import annotations

import math

import pytest

from qkwatch.client.outcomes import (
    Degradation,
    LossAlert,
    Outcome,
    OutcomeRule,
    choose_delta,
    final_heldout,
    judge,
    label,
    loss_visible_step,
    smoothed,
)

RAW = OutcomeRule(window=1)


def trained(n: int = 100, start: float = 5.5, end: float = 1.5) -> list[float]:
    """A loss falling smoothly from ``start`` to ``end``, with a small alternating wiggle (0.05)."""
    return [end + (start - end) * math.exp(-i / 15) + (0.05 if i % 2 else -0.05) for i in range(n)]


def test_a_run_that_trains_is_healthy() -> None:
    assert label(range(100), trained()).label == "healthy"


def test_a_nan_is_a_divergence_at_its_step() -> None:
    losses = trained()
    losses[40] = math.nan
    assert label(range(0, 1000, 10), losses) == Outcome("diverged", 400, "loss nan at step 400")


def test_a_run_that_never_trains_diverged_at_its_first_step() -> None:
    flat = [5.5 + (0.1 if i % 2 else -0.1) for i in range(50)]
    assert label(range(3, 53), flat).label == "diverged" and label(range(3, 53), flat).step == 3


def test_an_excursion_that_comes_back_is_a_spike_at_its_start() -> None:
    losses = trained()
    for i in range(60, 66):  # six steps 1.0 above the minimum, then back
        losses[i] += 1.0
    out = label(range(100), losses, RAW)
    assert (out.label, out.step) == ("spiked", 60)


def test_an_excursion_that_never_comes_back_is_a_divergence_at_its_start() -> None:
    losses = trained()[:60] + [3.5 + 0.01 * i for i in range(40)]
    out = label(range(100), losses, RAW)
    assert (out.label, out.step) == ("diverged", 60)


def test_an_excursion_shorter_than_for_steps_is_noise() -> None:
    losses = trained()
    for i in range(60, 64):  # four steps: one short of the default five
        losses[i] += 1.0
    assert label(range(100), losses, RAW).label == "healthy"
    assert label(range(100), losses, OutcomeRule(for_steps=4, window=1)).label == "spiked"


def test_delta_is_measured_from_the_running_minimum() -> None:
    losses = trained()
    for i in range(60, 70):
        losses[i] += 0.45  # under 0.5 above the minimum (plus the wiggle): no excursion
    assert label(range(100), losses, RAW).label == "healthy"
    assert label(range(100), losses, OutcomeRule(delta=0.3, window=1)).label == "spiked"


def test_parse_and_describe_round_trip() -> None:
    rule = OutcomeRule.parse("delta=0.7,for=3,window=10")
    assert rule == OutcomeRule(0.7, 3, 10) and OutcomeRule.parse(rule.describe()) == rule
    assert OutcomeRule.parse("delta=0.7") == OutcomeRule(0.7, 5, 20)
    assert OutcomeRule.parse("") == OutcomeRule()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("delta=-1", "delta must be a number > 0"),
        ("for=0", "for must be a whole number >= 1"),
        ("limit=3", "unknown outcome key 'limit'"),
        ("delta=x", "delta must be a number"),
    ],
)
def test_a_bad_rule_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OutcomeRule.parse(text)


def test_mismatched_or_empty_input_is_refused() -> None:
    with pytest.raises(ValueError, match="3 steps but 2 losses"):
        label([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="no loss was logged"):
        label([], [])


def test_the_trailing_mean_is_exact() -> None:
    assert smoothed([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert smoothed([4.0, 2.0], 20) == [4.0, 3.0]  # fewer values at the start


def noisy(n: int = 300, sigma: float = 0.2, seed: int = 0) -> list[float]:
    """A healthy run as the suite's data make it: 0.2 nats of batch noise, and now and then an easy batch."""
    import random

    rng = random.Random(seed)
    base = trained(n, end=2.0)
    return [x + rng.gauss(0, sigma) - (0.6 if i % 37 == 0 else 0.0) for i, x in enumerate(base)]


def test_batch_noise_and_easy_batches_are_not_a_spike_of_the_smoothed_loss() -> None:
    losses = noisy()
    assert label(range(300), losses).label == "healthy"
    assert label(range(300), losses, RAW).label == "spiked"  # v1's mistake, unsmoothed


def test_a_sustained_rise_is_a_spike_where_the_smoothed_loss_crosses() -> None:
    losses = trained(300, end=2.0)
    for i in range(150, 190):  # 40 steps a whole nat higher, then back
        losses[i] += 1.0
    out = label(range(300), losses)
    rise = [i for i, x in enumerate(smoothed(losses, 20)) if i >= 150 and x >= min(smoothed(losses, 20)[:i]) + 0.5]
    assert (out.label, out.step) == ("spiked", rise[0])
    assert 150 < out.step < 165  # the trailing mean of 20 crosses half a nat after about 10 steps


# --- where a run ends (v3) ---------------------------------------------------------------------------


def test_the_final_held_out_loss_is_the_mean_of_the_last_k_and_inf_when_not_finite() -> None:
    assert final_heldout([3.0, 2.0, 1.5, 1.4, 1.3], 3) == pytest.approx(1.4)
    assert final_heldout([1.0], 3) == 1.0
    assert final_heldout([], 3) == math.inf
    assert final_heldout([1.0, math.nan, 1.2], 3) == math.inf


def test_delta_is_three_sqrt_two_pooled_standard_deviations_rounded_up() -> None:
    """Groups (1.0, 1.2) and (2.0, 2.0, 2.3): sums of squares 0.02 and 0.06 over 1 + 2 degrees of
    freedom, sd = sqrt(0.08 / 3) = 0.16330; 3 sqrt(2) x 0.16330 = 0.6928, rounded up to 0.70."""
    delta, spread = choose_delta([[1.0, 1.2], [2.0, 2.0, 2.3], [5.0]])
    assert spread == pytest.approx(math.sqrt(0.08 / 3))
    assert delta == 0.70
    assert choose_delta([[1.0, 1.0]])[0] == 0.0  # no spread, no margin: the rule says so, not a guess
    with pytest.raises(ValueError, match="two finite final losses"):
        choose_delta([[1.0], [math.nan, 2.0]])


def test_the_loss_alert_stays_quiet_on_a_run_that_keeps_falling() -> None:
    falling = [1.5 + 4.0 * math.exp(-i / 300) for i in range(800)]  # still 0.4 nats per 100 steps at step 600
    assert loss_visible_step(range(800), falling, 800) is None


def test_the_loss_alert_fires_where_the_loss_stalls_rises_or_is_not_finite() -> None:
    stalled = [5.5 - 0.02 * i if i < 120 else 3.1 for i in range(800)]  # flat at 3.1 from step 120
    # A smoothed value whose window holds m ramp values is 3.1 + 0.01 m (m + 1) / 20; it is within
    # 0.02 of 3.1 from m = 5 (step 139 - 5 = 134), so the stall fires 100 steps later, at 234.
    assert loss_visible_step(range(800), stalled, 800) == 234
    rising = [1.5 + 4.0 * math.exp(-i / 15) + (1.01 if i >= 150 else 0.0) for i in range(300)]
    # the smoothed loss is 1.5 + 1.01 (m + 1) / 20 (and a vanishing tail) at step 150 + m: 0.5 above its
    # minimum from m = 9
    assert loss_visible_step(range(300), rising, 300, LossAlert(start=10_000)) == 159  # the rise alone
    # with the stall on, a loss that stops falling is seen sooner: 0.25 up at step 154, no lower than at 54
    assert loss_visible_step(range(300), rising, 300) == 154
    broken = trained(300)
    broken[77] = math.inf
    assert loss_visible_step(range(300), broken, 300) == 77


def test_a_stall_late_in_the_run_is_the_schedule_not_trouble() -> None:
    """A cosine decay flattens every healthy run at the end: after 0.75 of the steps, flat is no alarm."""
    late = [5.5 - 0.005 * i if i < 650 else 5.5 - 0.005 * 650 for i in range(800)]
    assert loss_visible_step(range(800), late, 800) is None
    # slope 0.005: within 0.02 of the flat from m = 12 ramp values in the window (step 657), +100
    assert loss_visible_step(range(800), late, 800, LossAlert(until=1.0)) == 757


def test_judge_puts_divergence_first_then_where_the_run_ends() -> None:
    rule = Degradation(delta=0.1)
    losses = trained()
    assert judge(range(100), losses, 1.59, 1.50, rule).label == "healthy"
    ended = judge(range(100), losses, 1.61, 1.50, rule, visible=40)  # at least delta worse
    assert ended.label == "degraded" and ended.step == 40 and "1.610 >= reference 1.500" in ended.why
    assert judge(range(100), losses, 1.61, 1.50, rule).step == 99  # the loss never showed it: the end
    assert judge(range(100), losses, 9.0, None, rule).label == "healthy"  # no reference: its own
    spiked = trained()
    for i in range(60, 66):
        spiked[i] += 1.0
    assert judge(range(100), spiked, 1.5, 1.5, rule, rule=RAW).label == "spiked"
    assert judge(range(100), spiked, 2.0, 1.5, rule, rule=RAW).label == "degraded"
    nan = trained()
    nan[10] = math.nan
    assert judge(range(100), nan, 2.0, 1.5, rule).label == "diverged"
    with pytest.raises(ValueError, match="delta must be a number > 0"):
        Degradation(delta=0.0)
