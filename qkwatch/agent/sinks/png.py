"""A layer x step heatmap as a PNG image, with numpy and zlib only (no Pillow, no matplotlib).

Colours are the live page's and the report's (``qkwatch.contract.colour_scale``): a metric read
against a threshold (QKAI at the collapse threshold, attention entropy at H*, as the catalogue says)
is drawn on the scale that breaks there, over the metric's own range (QKAI: [0, 1]); any other
metric on the same colours as one ramp, light to dark, from the picture's smallest value to its
largest. Where nothing was measured (a layer another rank measures, a step without the metric, a
value that is not finite) the cell is the scale's gap colour. Layer 0 is the top row, the first
step the left column; each cell is a block of pixels, so a small model still makes a picture one
can see.

Pure: bytes out, no files.
"""

from __future__ import annotations

import importlib.util
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from qkwatch.contract.colour_scale import ABOVE, BELOW, GAP, rgb
from qkwatch.contract.metrics import CATALOGUE
from qkwatch.contract.thresholds import Thresholds

WIDTH = 768
"""About how wide a picture is drawn (pixels), however many steps."""
HEIGHT = 384
"""About how tall (pixels), however many layers."""


def heatmap_png(metric: str, layers: Sequence[Sequence[float | None]], thresholds: Thresholds | None = None) -> bytes:
    """``layers[i][j]`` (layer i at the j-th step) drawn as a PNG (see the module's docstring)."""
    return png_bytes(heatmap_rgb(metric, layers, thresholds))


def heatmap_rgb(
    metric: str, layers: Sequence[Sequence[float | None]], thresholds: Thresholds | None = None
) -> np.ndarray:
    """The picture as an ``(height, width, 3)`` uint8 array (``height`` a multiple of the layers)."""
    grid = np.array([[np.nan if v is None else v for v in row] for row in layers], dtype=np.float64)
    if grid.size == 0:
        grid = np.full((max(1, len(layers)), 1), np.nan)
    rgb = _colours(metric, grid, thresholds or Thresholds.from_env())
    n_layers, n_steps = grid.shape
    cell_h = max(2, min(24, HEIGHT // n_layers))
    cell_w = max(1, min(16, WIDTH // n_steps))
    return np.repeat(np.repeat(rgb, cell_h, axis=0), cell_w, axis=1)  # (layers * cell_h, steps * cell_w, 3)


def png_bytes(rgb: np.ndarray) -> bytes:
    """An ``(height, width, 3)`` uint8 array as a PNG file (8-bit RGB, no filter, zlib level 6)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (height, width, 3) uint8 array, got {rgb.dtype} {rgb.shape}")
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _colours(metric: str, grid: np.ndarray, thresholds: Thresholds) -> np.ndarray:
    """Each finite cell's colour, GAP elsewhere: ``(layers, steps, 3)`` uint8."""
    finite = np.isfinite(grid)
    out = np.empty((*grid.shape, 3), dtype=np.uint8)
    out[...] = rgb(GAP)
    if not finite.any():
        return out
    entry = CATALOGUE.get(metric)
    values = grid[finite]
    if entry is not None and entry.threshold is not None and entry.low is not None and entry.high is not None:
        t = getattr(thresholds, entry.threshold)
        below = values < t  # the threshold itself takes the colour above (colour_scale.colour_at)
        colours = np.empty((values.size, 3), dtype=np.uint8)
        colours[below] = _ramp(BELOW, values[below], entry.low, t)
        colours[~below] = _ramp(ABOVE, values[~below], t, entry.high)
    else:
        lo, hi = float(values.min()), float(values.max())
        colours = _ramp(BELOW + ABOVE, values, lo, hi if hi > lo else lo + 1.0)
    out[finite] = colours
    return out


def _ramp(stops: tuple[str, ...], values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``colour_scale.colour_at`` on one side of the break, for many values: linear in sRGB between
    evenly spaced stops over [lo, hi], clamped, rounded half to even as Python's ``round``."""
    colours = np.array([rgb(c) for c in stops], dtype=np.float64)  # (stops, 3)
    x = np.clip((values - lo) / (hi - lo), 0.0, 1.0) * (len(stops) - 1)
    i = np.minimum(x.astype(np.int64), len(stops) - 2)
    frac = (x - i)[:, None]
    out: np.ndarray = np.rint(colours[i] + (colours[i + 1] - colours[i]) * frac).astype(np.uint8)
    return out


def has_pillow() -> bool:
    """Whether Pillow is installed (looked up, not imported), which W&B's and MLflow's image types need."""
    return importlib.util.find_spec("PIL") is not None
