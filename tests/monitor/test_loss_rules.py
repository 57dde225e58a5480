"""Loss-only alert rules (``qkwatch.rules.loss_rules``): closed forms, and an independent plain-Python
reference for every kind on random losses (the module computes with numpy running sums)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkwatch.client.outcomes import smoothed
from qkwatch.rules.loss_rules import KINDS, TUNED_BASELINE, LossRule, LossSeries


def line(n: int, start: float = 5.5, per_step: float = -0.01) -> tuple[list[int], list[float]]:
    steps = list(range(n))
    return steps, [start + per_step * s for s in steps]


def test_level_and_fall_check_the_smoothed_loss_at_their_step() -> None:
    steps, losses = line(400)  # 5.5 - 0.01 s: smoothed over 20 at step 100, the mean of 81..100 = 4.595
    assert LossRule.parse("level:at=100,above=4.59").first_firing(steps, losses, 400) == 100
    assert LossRule.parse("level:at=100,above=4.6").first_firing(steps, losses, 400) is None
    # fall: 5.5 - 4.595 = 0.905 against fraction x 5.5: 0.905 / 5.5 = 0.1645
    assert LossRule.parse("fall:at=100,fraction=0.17").first_firing(steps, losses, 400) == 100
    assert LossRule.parse("fall:at=100,fraction=0.16").first_firing(steps, losses, 400) is None
    # a step past the run's end is never reached
    assert LossRule.parse("level:at=500,above=0").first_firing(steps, losses, 400) is None


def test_rise_fires_when_its_streak_completes_not_where_it_started() -> None:
    steps = list(range(60))
    losses = [3.0] * 30 + [4.0] * 30  # unsmoothed (window 1): 1 nat above the minimum from step 30
    assert LossRule.parse("rise:rise=0.5,for_steps=5,window=1").first_firing(steps, losses, 60) == 34
    assert LossRule.parse("rise:rise=0.5,for_steps=1,window=1").first_firing(steps, losses, 60) == 30
    assert LossRule.parse("rise:rise=1.5,for_steps=1,window=1").first_firing(steps, losses, 60) is None


def test_plateau_and_slope() -> None:
    steps = list(range(300))
    losses = [5.0 - 0.01 * s if s < 150 else 3.5 + 0.002 * (s - 150) for s in steps]  # falls, then creeps up
    # the smoothed loss falls 0.01 a step until 150 (so 0.5 over 50 steps), after that rises
    plateau = LossRule.parse("plateau:span=50,drop=0.05,start=100,until=1,window=1")
    # s[i - 50] - s[i] = (5.5 - 0.01 i) - (3.2 + 0.002 i) = 2.3 - 0.012 i < 0.05 from i = 188 (3.62 to 3.576)
    assert plateau.first_firing(steps, losses, 300) == 188
    assert (
        LossRule.parse("plateau:span=50,drop=0.05,start=100,until=0.5,window=1").first_firing(steps, losses, 300)
        is None
    )
    slope = LossRule.parse("slope:span=10,per_100=0.1,start=0,window=1")
    # the window 149..158 holds the last fall (3.51 -> 3.5) and nine rises: numpy's least-squares line says
    # 0.00135 per step, above 0.1 per 100; the window before (148..157) 0.00018
    fitted = [np.polyfit(steps[i - 9 : i + 1], losses[i - 9 : i + 1], 1)[0] for i in (157, 158)]
    assert fitted[0] * 100 < 0.1 < fitted[1] * 100
    assert slope.first_firing(steps, losses, 300) == 158
    assert LossRule.parse("slope:span=10,per_100=0.3,start=0,window=1").first_firing(steps, losses, 300) is None


def test_every_kind_fires_at_the_first_non_finite_loss() -> None:
    steps, losses = line(100)
    losses[42] = math.nan
    for kind in KINDS:
        rule = next(r for r in _examples() if r.kind == kind)
        assert rule.first_firing(steps, losses, 100) == 42, kind
    losses[10] = math.inf
    assert LossRule.parse("level:at=90,above=100").first_firing(steps, losses, 100) == 10


def test_a_rule_reads_back_from_its_text_and_bad_text_is_named() -> None:
    for rule in _examples():
        assert LossRule.parse(rule.text()) == rule
    assert TUNED_BASELINE.text() == "level:at=300,above=2.15"
    for text, needle in (
        ("wobble:x=1", "kind must be one of level, fall, rise, plateau, slope"),
        ("level:at=100", "level: needs above"),
        ("level:at=100,above=2,drop=1", "level: takes no drop"),
        ("level:at=x,above=2", "at='x' is not a number"),
        ("level:at=0,above=2", "at must be a whole number >= 1"),
        ("level:at=10,above=inf", "above must be a finite number"),
        ("rise:rise=1,for_steps=2,window=0", "window must be a whole number >= 1"),
    ):
        with pytest.raises(ValueError, match=needle):
            LossRule.parse(text)
    with pytest.raises(ValueError, match="3 steps but 2 losses"):
        TUNED_BASELINE.first_firing([0, 1, 2], [1.0, 2.0], 3)


def _examples() -> list[LossRule]:
    return [
        LossRule.parse(t)
        for t in (
            "level:at=50,above=3",
            "fall:at=50,fraction=0.3",
            "rise:rise=0.2,for_steps=5",
            "plateau:span=20,drop=0.01,start=10,until=0.9,window=5",
            "slope:span=20,per_100=0.05,start=10",
        )
    ]


# --- an independent reference ------------------------------------------------------------------------------


def reference(rule: LossRule, steps: list[int], losses: list[float], total: int) -> int | None:
    """The rule's definition read literally, one step at a time, in plain Python."""
    p = rule.params
    cut = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    finite = losses[:cut]
    s = smoothed(finite, rule.window) if finite else []
    hit = None
    if rule.kind in ("level", "fall"):
        i = next((i for i, step in enumerate(steps[: len(s)]) if step >= p["at"]), None)
        if i is not None and (
            s[i] > p["above"] if rule.kind == "level" else losses[0] - s[i] < p["fraction"] * losses[0]
        ):
            hit = i
    elif rule.kind == "rise":
        run, low = 0, math.inf
        for i, x in enumerate(s):
            low = min(low, x)
            run = run + 1 if x >= low + p["rise"] else 0
            if run >= p["for_steps"]:
                hit = i
                break
    elif rule.kind == "plateau":
        span = int(p["span"])
        hit = next(
            (
                i
                for i in range(span, len(s))
                if p["start"] <= steps[i] <= p["until"] * total and s[i - span] - s[i] < p["drop"]
            ),
            None,
        )
    else:
        span = int(p["span"])
        for i in range(span - 1, len(s)):
            xs, ys = steps[i - span + 1 : i + 1], s[i - span + 1 : i + 1]
            mx, my = sum(xs) / span, sum(ys) / span
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
            if steps[i] >= p["start"] and slope * 100 > p["per_100"]:
                hit = i
                break
    found = [i for i in (hit, cut) if i is not None]
    return steps[min(found)] if found else None


RULES = st.one_of(
    st.builds(
        lambda a, x, w: LossRule("level", {"at": a, "above": x}, w),
        st.integers(1, 80),
        st.floats(1, 6),
        st.integers(1, 9),
    ),
    st.builds(
        lambda a, f, w: LossRule("fall", {"at": a, "fraction": f}, w),
        st.integers(1, 80),
        st.floats(0.01, 0.9),
        st.integers(1, 9),
    ),
    st.builds(
        lambda r, n, w: LossRule("rise", {"rise": r, "for_steps": n}, w),
        st.floats(0.01, 1),
        st.integers(1, 6),
        st.integers(1, 9),
    ),
    st.builds(
        lambda n, d, b, u, w: LossRule("plateau", {"span": n, "drop": d, "start": b, "until": u}, w),
        st.integers(1, 20),
        st.floats(-0.2, 0.5),
        st.integers(1, 40),
        st.floats(0.1, 1),
        st.integers(1, 9),
    ),
    st.builds(
        lambda n, x, b, w: LossRule("slope", {"span": n, "per_100": x, "start": b}, w),
        st.integers(2, 20),
        st.floats(-2, 2),
        st.integers(1, 40),
        st.integers(1, 9),
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    RULES,
    st.lists(st.floats(0.5, 6.0) | st.sampled_from([math.nan, math.inf]), min_size=1, max_size=90),
    st.integers(1, 3),
)
def test_every_kind_agrees_with_the_literal_reference(rule: LossRule, losses: list[float], stride: int) -> None:
    steps = [stride * i for i in range(len(losses))]
    total = steps[-1] + 1
    assert LossSeries(steps, losses).first_firing(rule, total) == reference(rule, steps, losses, total)
