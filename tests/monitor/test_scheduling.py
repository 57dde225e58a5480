"""The entropy-floor schedule against its closed form, and its config validation."""

from __future__ import annotations

import math

import pytest

from qkwatch.contract.scheduling import (
    ScheduleConfig,
    apply_overrides,
    check_override,
    ema_update,
    entropy_floor,
    sigmoid,
)


def test_formula_matches_the_closed_form():
    cfg = ScheduleConfig(lambda_0=0.3, h_star=0.7, beta=0.05)
    h = [0.7, 0.75, 0.6, 1.0, 0.0]
    expected = [0.3 / (1 + math.exp(-(x - 0.7) / 0.05)) for x in h]
    assert entropy_floor(h, cfg) == pytest.approx(expected)
    assert entropy_floor([0.7], cfg) == [pytest.approx(0.15)]  # half of lambda_0 at the target


def test_no_evidence_means_no_penalty():
    assert entropy_floor([None, math.nan], ScheduleConfig()) == [0.0, 0.0]


def test_sigmoid_is_stable_at_extremes():
    assert sigmoid(-1000) == 0.0 and sigmoid(1000) == 1.0 and sigmoid(0) == 0.5


def test_ema_initialises_then_smooths_and_ignores_nan():
    cfg = ScheduleConfig(ema=0.9)
    assert ema_update(None, 0.5, cfg) == 0.5
    assert ema_update(0.5, 1.0, cfg) == pytest.approx(0.55)
    assert ema_update(0.5, math.nan, cfg) == 0.5


def test_defaults_are_documented_values():
    assert ScheduleConfig.from_mapping(None) == ScheduleConfig(
        lambda_0=1e-4, h_star=0.85, beta=0.04, ema=0.8, lambda_max=1e-2, floor=0.1
    )
    assert ScheduleConfig(lambda_0=0.3).lambda_max == pytest.approx(30.0)  # 100 x lambda_0 unless given


def test_default_split_between_seed_000s_healthy_and_collapsed_entropies():
    """The reasoning in ScheduleConfig's docstring, held: healthy 0.76 gets <= 0.1 lambda_0, collapsed 0.94 >= 0.9."""
    cfg = ScheduleConfig()
    healthy, collapsed = entropy_floor([0.71, 0.76, 0.94], cfg)[1:], entropy_floor([0.94], cfg)[0]
    assert healthy[0] <= 0.1 * cfg.lambda_0 and collapsed >= 0.9 * cfg.lambda_0
    assert cfg.flagged([collapsed, 0.1 * cfg.lambda_0, 0.0]) == [True, False, False]


@pytest.mark.parametrize(
    ("mapping", "key"),
    [
        ({"beta": 0}, "beta"),
        ({"ema": 1.0}, "ema"),
        ({"lambda_0": 0.02, "lambda_max": 0.01}, "lambda_0"),
        ({"h_star": "x"}, "h_star"),
        ({"lambda_max": -1}, "lambda_max"),
        ({"floor": 1.0}, "floor"),
        ({"gamma": 1}, "gamma"),
        ({"beta": math.inf}, "beta"),
        ({"beta": True}, "beta"),
        ({"ema": False}, "ema"),
        ({"lambda_0": 10**400}, "lambda_0"),
        ({"floor": None}, "floor"),
        ({"h_star": [0.8]}, "h_star"),
    ],
)
def test_invalid_config_names_the_key(mapping, key):
    with pytest.raises(ValueError, match=f"schedule.{key}"):
        ScheduleConfig.from_mapping(mapping)


@pytest.mark.parametrize("mapping", ["fast", [("beta", 0.1)], 0.1])
def test_a_schedule_that_is_not_an_object_is_refused(mapping):
    with pytest.raises(ValueError, match="schedule must be an object"):
        ScheduleConfig.from_mapping(mapping)


def test_parameters_are_floats_and_null_means_the_default():
    cfg = ScheduleConfig.from_mapping({"lambda_0": 1, "beta": 2, "lambda_max": None})
    assert cfg == ScheduleConfig(lambda_0=1.0, beta=2.0) and isinstance(cfg.beta, float) and cfg.lambda_max == 100.0
    assert ScheduleConfig.from_mapping(None) == ScheduleConfig.from_mapping({}) == ScheduleConfig()


def test_a_huge_integer_built_directly_is_a_named_value_error():
    with pytest.raises(ValueError, match=r"schedule.beta must be a finite number, got an integer of \d+ bits"):
        ScheduleConfig(beta=10**5000)


def test_overrides_are_bounded_and_applied():
    cfg = ScheduleConfig(lambda_max=0.5)
    check_override(2, 0.5, cfg, 4)
    for layer, value, n in ((4, 0.1, 4), (1, 0.6, 4), (1, -0.01, None), (1, math.nan, None), (-1, 0.1, None)):
        with pytest.raises(ValueError):
            check_override(layer, value, cfg, n)
    assert apply_overrides([0.1, 0.2, 0.3], {1: 0.0, 7: 0.5}) == [0.1, 0.0, 0.3]
