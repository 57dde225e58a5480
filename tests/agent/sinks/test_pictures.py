"""The heatmaps' picture and history: PNG bytes any reader decodes, the live page's colours, a
history bounded however long the run."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
from PIL import Image

from qkwatch.agent.sinks.history import LayerHistory
from qkwatch.agent.sinks.png import heatmap_rgb, png_bytes
from qkwatch.contract.colour_scale import ABOVE, BELOW, GAP, colour_at
from qkwatch.contract.metrics import primary_layer_metrics
from qkwatch.contract.thresholds import Thresholds


def hexes(rgb: np.ndarray) -> list[str]:
    return ["#" + "".join(f"{c:02x}" for c in px) for px in rgb]


def test_png_bytes_decode_to_the_same_pixels() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(png_bytes(rgb))).convert("RGB"))
    assert np.array_equal(decoded, rgb)
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(rgb.astype(np.float32))


def test_qkai_takes_the_live_pages_colours_breaking_at_the_threshold() -> None:
    t = Thresholds(collapse=0.6)
    values = [0.0, 0.3, 0.5999, 0.6, 0.61, 0.95, 1.0, 2.0]
    rgb = heatmap_rgb("qkai", [[*values, None, float("nan")]], t)
    cells = hexes(rgb[0, :: rgb.shape[1] // 10])  # one pixel per cell
    assert cells[:8] == [colour_at(v, 0.0, 1.0, 0.6) for v in values]
    assert cells[8:] == [GAP, GAP]
    assert cells[2] != cells[3]  # the break


def test_any_other_metric_runs_light_to_dark_over_its_own_range() -> None:
    rgb = heatmap_rgb("stable_rank", [[2.0], [5.0], [8.0], [None]])
    rows = hexes(rgb[:: rgb.shape[0] // 4, 0])
    assert rows == [BELOW[0], BELOW[-1], ABOVE[-1], GAP]  # 9 stops, BELOW then ABOVE: the middle is BELOW[-1]


def test_the_history_stays_bounded_and_spans_the_run() -> None:
    history = LayerHistory(n_layers=2, columns=16)
    for step in range(0, 10_000, 10):
        history.add(step, {0: step / 10_000, 1: 0.5} if step % 20 else {0: step / 10_000})
    steps, layers = history.grid()
    assert len(steps) <= 17 and steps[0] == 0 and steps[-1] == 9990
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}
    assert len(gaps) == 1  # evenly spread over the run (the newest report added at the end)
    assert layers[0] == [s / 10_000 for s in steps]
    assert all((v is None) == (s % 20 == 0) for s, v in zip(steps, layers[1], strict=True))


def test_the_heatmaps_draw_the_catalogues_primary_layer_metrics() -> None:
    assert primary_layer_metrics() == ("qkai", "stable_rank", "attn_entropy", "logit_max", "lambda")
