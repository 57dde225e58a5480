"""The outcome rule on losses whose label is known by construction."""

from __future__ import annotations

import math

import pytest

from qkwatch.monitor.outcomes import Outcome, OutcomeRule, label


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
    out = label(range(100), losses)
    assert (out.label, out.step) == ("spiked", 60)


def test_an_excursion_that_never_comes_back_is_a_divergence_at_its_start() -> None:
    losses = trained()[:60] + [3.5 + 0.01 * i for i in range(40)]
    out = label(range(100), losses)
    assert (out.label, out.step) == ("diverged", 60)


def test_an_excursion_shorter_than_for_steps_is_noise() -> None:
    losses = trained()
    for i in range(60, 64):  # four steps: one short of the default five
        losses[i] += 1.0
    assert label(range(100), losses).label == "healthy"
    assert label(range(100), losses, OutcomeRule(for_steps=4)).label == "spiked"


def test_delta_is_measured_from_the_running_minimum() -> None:
    losses = trained()
    for i in range(60, 70):
        losses[i] += 0.45  # under 0.5 above the minimum (plus the wiggle): no excursion
    assert label(range(100), losses).label == "healthy"
    assert label(range(100), losses, OutcomeRule(delta=0.3)).label == "spiked"


def test_parse_and_describe_round_trip() -> None:
    rule = OutcomeRule.parse("delta=0.7,for=3")
    assert rule == OutcomeRule(0.7, 3) and OutcomeRule.parse(rule.describe()) == rule
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
