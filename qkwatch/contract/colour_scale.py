"""The colour scale of a value read against a threshold, in one place (pure, stdlib only).

QKAI is drawn on it with its break at the collapse threshold: on the live page (which reads the
colours from ``/ui/config.json``), in ``qkwatch report`` and in the Grafana dashboards, whose
attention entropy panels break at H* on the same colours.

Below the threshold the ramp is sequential, calm to wary: from a light, nearly grey blue far below
to a light straw just under the threshold, CIE L* falling from 95 to 77 while the chroma rises from
6 to 38. Above it the ramp is alarming: saturated orange (L* 60) to dark red (L* 30). Every colour
above is darker than every colour below, by 14 L* or more and 29 CIE76 delta-E or more even under a
simulated deuteranopia, protanopia or tritanopia (Machado et al. 2009; tests/monitor/ui/
test_live_page.py), so the break reads without hue, and a layer looks more alarming the closer it
is to the threshold.
"""

from __future__ import annotations

import itertools

BELOW = ("#e7f2fc", "#e4e4de", "#e3d6bf", "#e1c79e", "#e0b878")
"""From the bottom of the scale to just under the threshold."""
ABOVE = ("#e66e0c", "#da461c", "#c02221", "#891a24")
"""From just over the threshold to the top of the scale."""
GAP = "#ffffff"
"""The plot background, where nothing was measured (nan, inf, a step not reported): no colour of the scale."""


def colorscale(lo: float, hi: float, t: float) -> list[tuple[float, str]]:
    """Plotly colorscale stops for values in [lo, hi] with a sharp break at ``t`` (lo < t < hi).

    ``BELOW`` spreads evenly over [lo, t] and ``ABOVE`` over [t, hi]: two stops sit at t's position,
    so plotly draws no blend across it. Positions are fractions of [lo, hi], in [0, 1].
    """
    f = (t - lo) / (hi - lo)
    return _ramp(BELOW, 0.0, f) + _ramp(ABOVE, f, 1.0)


def colour_at(value: float, lo: float, hi: float, t: float) -> str:
    """The colour plotly gives ``value`` on ``colorscale(lo, hi, t)``: linear in sRGB between neighbouring
    stops, clamped to [lo, hi]; ``t`` itself takes the colour above."""
    colours, a, b = (BELOW, lo, t) if value < t else (ABOVE, t, hi)
    x = min(max((value - a) / (b - a), 0.0), 1.0) * (len(colours) - 1)  # in [0, len - 1]
    i = min(int(x), len(colours) - 2)
    left, right = rgb(colours[i]), rgb(colours[i + 1])
    return "#" + "".join(f"{round(p + (q - p) * (x - i)):02x}" for p, q in zip(left, right, strict=True))


def discrete(t: float, edges: tuple[float, ...]) -> list[tuple[float | None, str]]:
    """Discrete steps on [0, 1] breaking at ``t``, as Grafana's threshold steps: (start, colour), the first
    start None (everything below the second).

    ``edges`` are offsets from ``t`` (0 is ``t`` itself); a step that would start outside (0, 1) is
    dropped. Each step takes the colour of the scale on [0, 1] at the middle of the values it covers.
    """
    starts = sorted({t if d == 0 else round(t + d, 3) for d in edges if 0 < t + d < 1})
    bounds = [0.0, *starts, 1.0]
    colours = [colour_at((a + b) / 2, 0.0, 1.0, t) for a, b in itertools.pairwise(bounds)]
    return list(zip([None, *starts], colours, strict=True))


def as_json() -> dict[str, str | list[str]]:
    """The scale as ``/ui/config.json`` serves it to the live page."""
    return {"below": list(BELOW), "above": list(ABOVE), "gap": GAP}


def _ramp(colours: tuple[str, ...], a: float, b: float) -> list[tuple[float, str]]:
    n = len(colours) - 1
    return [(a + (b - a) * i / n, c) for i, c in enumerate(colours)]


def rgb(colour: str) -> tuple[int, int, int]:
    """``"#e66e0c"`` as ``(230, 110, 12)``."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)
