"""The outcome rule on losses whose label is known by construction.

``RAW`` (no smoothing) checks the excursion logic step by step; the default rule smooths with a
trailing mean of 20, checked on its own below.
"""

from __future__ import annotations

import math

import pytest

from qkwatch.monitor.outcomes import Outcome, OutcomeRule, label, smoothed

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
