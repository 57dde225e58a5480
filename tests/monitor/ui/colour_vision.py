"""Colours as people with a colour-vision deficiency see them, and how far apart they look (pure numpy).

* sRGB to linear RGB: ``c / 12.92`` up to 0.04045, else ``((c + 0.055) / 1.055) ** 2.4`` (IEC 61966-2-1).
* Dichromacy: Machado, Oliveira and Fernandes, "A Physiologically-based Model for Simulation of Color
  Vision Deficiency" (IEEE TVCG 2009), Table 1 at severity 1.0: a 3x3 matrix on linear RGB, clipped to [0, 1].
* CIE L*a*b* (D65 white) from linear RGB through XYZ; the distance is CIE76 delta-E, the Euclidean
  distance in L*a*b* (about 2.3 is a just-noticeable difference).
"""

from __future__ import annotations

import numpy as np

MACHADO = {
    "protanopia": np.array(
        [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]]
    ),
    "deuteranopia": np.array(
        [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]]
    ),
    "tritanopia": np.array(
        [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]]
    ),
}
"""Linear RGB -> linear RGB as a dichromat sees it (Machado et al. 2009, severity 1.0)."""
VISIONS = ("normal", *MACHADO)
SRGB_TO_XYZ = np.array(
    [[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750], [0.0193339, 0.1191920, 0.9503041]]
)
WHITE = SRGB_TO_XYZ.sum(axis=1)  # XYZ of linear RGB (1, 1, 1): D65


def srgb(colours: list[str]) -> np.ndarray:
    """``#rrggbb`` colours as sRGB in [0, 1]: (n, 3)."""
    return np.array([[int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)] for c in colours])


def ramp(colours: list[str], n: int = 64) -> np.ndarray:
    """``n`` colours spread evenly over a ramp through ``colours``, interpolated linearly in sRGB as plotly's
    colour scales are: (n, 3)."""
    stops = srgb(colours)
    x = np.linspace(0, len(stops) - 1, n)
    i = np.minimum(x.astype(int), len(stops) - 2)
    f = (x - i)[:, None]
    return stops[i] * (1 - f) + stops[i + 1] * f


def seen(rgb: np.ndarray, vision: str) -> np.ndarray:
    """sRGB colours (n, 3) as CIE L*a*b* (n, 3) seen with ``vision`` (one of ``VISIONS``)."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    if vision != "normal":
        linear = np.clip(linear @ MACHADO[vision].T, 0, 1)
    xyz = linear @ SRGB_TO_XYZ.T / WHITE  # (n, 3), each relative to the white
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], axis=1)


def delta_e(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """CIE76 distance between every colour of ``a`` (n, 3) and every colour of ``b`` (m, 3), in L*a*b*: (n, m)."""
    return np.linalg.norm(a[:, None, :] - b[None, :, :], axis=-1)
