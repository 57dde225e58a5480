"""Frames: packing, per-step merging and bucket reduction (pure)."""

from __future__ import annotations

import math

from qkwatch.monitor.store.values import frames


def rows(*frames_):
    return [(step, vals, present, has_nan) for (_, step, _, vals, present, has_nan) in frames_]


def test_pack_marks_missing_layers_and_nan():
    full = frames.pack("qkai", 3, [0.1, 0.2])
    assert full[2] == "a2" and full[4] is None and full[5] is False
    part = frames.pack("qkai", 3, [None, math.nan])
    assert part[4] == b"\x00\x01" and part[5] is True and part[2] != "a2"
    assert frames.pack("qkai", 3, [None, None]) is None


def test_later_attempt_overwrites_within_a_step():
    merged = frames.merge_steps(rows(frames.pack("m", 1, [0.1, 0.2]), frames.pack("m", 1, [None, 0.9])))
    assert [(s.step, s.values) for s in merged] == [(1, [0.1, 0.9])]


def test_reduction_by_agg():
    steps = frames.merge_steps(rows(*(frames.pack("m", s, [float(s), -float(s)]) for s in range(4))))
    for agg, expected in (
        ("max", [[1.0, 0.0], [3.0, -2.0]]),
        ("min", [[0.0, -1.0], [2.0, -3.0]]),
        ("mean", [[0.5, -0.5], [2.5, -2.5]]),
    ):
        assert frames.heatmap(steps, 2, agg) == ([0, 2], [0, 1], expected, True)


def test_unmeasured_layers_are_dropped_and_gaps_are_none():
    steps = frames.merge_steps(rows(frames.pack("m", 0, [0.1, None, None]), frames.pack("m", 9, [None, 0.5, None])))
    assert frames.heatmap(steps, 100, "max") == ([0, 9], [0, 1], [[0.1, None], [None, 0.5]], False)
