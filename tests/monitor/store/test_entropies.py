"""The running entropies a batch moves (pure): forward in (attempt, step) order only."""

from __future__ import annotations

import math

import pytest

from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.monitor.store.runs.lambdas import Entropy, advance_entropies

CFG = ScheduleConfig(ema=0.5)


def test_the_first_value_initialises_and_the_next_ones_average() -> None:
    out = advance_entropies({}, 1, [(0, [0.8, None]), (1, [0.6, 0.9])], CFG)
    assert out == {0: Entropy(pytest.approx(0.7), 1, 1), 1: Entropy(0.9, 1, 1)}


def test_a_late_or_replayed_value_does_not_move_a_layer() -> None:
    state = {0: Entropy(0.5, 1, 10)}
    assert advance_entropies(state, 1, [(10, [0.9]), (4, [0.9])], CFG) == {}
    assert advance_entropies(state, 2, [(4, [0.9])], CFG) == {0: Entropy(0.7, 2, 4)}  # a resumed attempt does


def test_a_nan_leaves_the_running_value_and_nan_state_takes_the_next_finite_one() -> None:
    assert advance_entropies({0: Entropy(0.5, 1, 0)}, 1, [(1, [math.nan])], CFG) == {0: Entropy(0.5, 1, 1)}
    assert advance_entropies({0: Entropy(math.nan, 1, 0)}, 1, [(1, [0.4])], CFG) == {0: Entropy(0.4, 1, 1)}
