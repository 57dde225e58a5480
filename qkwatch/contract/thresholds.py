"""The two numbers that say when a layer's attention is in trouble, in one place (pure, stdlib only).

* ``collapse`` (0.70): a layer whose QKAI is above it is collapsing. Seed 000 reports that above
  about 0.70 the stable rank of W_Q W_K^T drops and mid-layer attention entropy climbs towards
  uniform. Independent random subspaces sit at r / d_model (0.25 on the small recipes, 0.0625 at
  1.3B), so 0.70 is 2.8x and 11.2x chance.
* ``h_star`` (0.85): the target normalised attention entropy H* of RAA's entropy-floor schedule
  (``contract.scheduling``), midway between seed 000's collapsed mid-layer entropy (0.94) and the
  same layers kept healthy by RAA (0.71-0.76).

Everything that shows or acts on them derives from here: the collector's settings
(``QKWATCH_COLLAPSE_THRESHOLD``, ``QKWATCH_H_STAR``), the default alert rules, the schedule's
default H*, the generated Prometheus rules and Grafana dashboards (``python -m qkwatch.dashboards.generate``),
the live page, ``qkwatch report`` and ``qkwatch analyze``. A test (tests/test_thresholds.py) fails
when either number is written as a literal anywhere else in the code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

COLLAPSE_THRESHOLD = 0.70
"""Default QKAI above which a layer counts as collapsing."""
H_STAR = 0.85
"""Default target normalised attention entropy of the entropy-floor schedule."""
ENV = {"collapse": "QKWATCH_COLLAPSE_THRESHOLD", "h_star": "QKWATCH_H_STAR"}
"""The environment variable that sets each field (the collector's ``Settings`` reads the same two)."""


@dataclass(frozen=True)
class Thresholds:
    """The collapse threshold and H*, validated together."""

    collapse: float = COLLAPSE_THRESHOLD
    """QKAI above this is collapse, in (0, 1)."""
    h_star: float = H_STAR
    """Target normalised attention entropy H*, in (0, 1)."""

    def __post_init__(self) -> None:
        for name in ("collapse", "h_star"):
            value = getattr(self, name)
            try:
                finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            except OverflowError:  # an int too large for a float
                finite = False
            if not finite:
                big = isinstance(value, int) and not isinstance(value, bool)
                shown = f"an integer of {value.bit_length()} bits" if big else repr(value)
                raise ValueError(f"{name} must be a finite number, got {shown}")
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Thresholds:
        """The defaults, each replaced by its environment variable where that is set.

        Raises:
            ValueError: naming the variable, for a value that is not a number in (0, 1).
        """
        return cls.resolve(environ=environ)

    @classmethod
    def resolve(
        cls, collapse: float | None = None, h_star: float | None = None, environ: Mapping[str, str] | None = None
    ) -> Thresholds:
        """Each value from the argument when given, else its environment variable, else the default.

        Raises:
            ValueError: naming the variable or the argument, for a value that is not a number in (0, 1).
        """
        given = {name: value for name, value in (("collapse", collapse), ("h_star", h_star)) if value is not None}
        found = _read_environ(os.environ if environ is None else environ, [n for n in ENV if n not in given])
        try:
            return cls(**found, **given)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise ValueError(f"{ENV[name] if name in found else name}: {exc}") from None


def _read_environ(environ: Mapping[str, str], names: Iterable[str]) -> dict[str, float]:
    """The fields of ``names`` whose variable is set (and not blank), parsed as numbers."""
    values: dict[str, float] = {}
    for name in names:
        raw = environ.get(ENV[name])
        if raw is None or not raw.strip():
            continue
        try:
            values[name] = float(raw)
        except ValueError:
            raise ValueError(f"{ENV[name]} must be a number, got {raw!r}") from None
    return values


def as_text(value: float) -> str:
    """A threshold as generated files and messages write it: 0.7 -> "0.70", 0.725 -> "0.725".

    Two decimals where they say it exactly, else Python's shortest repr: never rounded, so a
    PromQL or SQL comparison built from the text compares with the same number.
    """
    text = f"{value:.2f}"
    return text if float(text) == value else repr(float(value))
