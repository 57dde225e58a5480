"""The two numbers that say when a layer's attention is in trouble, in one place (pure, stdlib only).

* ``collapse`` (0.70): a layer whose QKAI is above it is collapsing. Seed 000 reports that above
  about 0.70 the stable rank of W_Q W_K^T drops and mid-layer attention entropy climbs towards
  uniform. Independent random subspaces sit at r / d_model (0.25 on the small recipes, 0.0625 at
  1.3B), so 0.70 is 2.8x and 11.2x chance.
* ``h_star`` (0.85): the target normalised attention entropy H* of RAA's entropy-floor schedule
  (``monitor.scheduling``), midway between seed 000's collapsed mid-layer entropy (0.94) and the
  same layers kept healthy by RAA (0.71-0.76).

Everything that shows or acts on them derives from here: the collector's settings
(``QKWATCH_COLLAPSE_THRESHOLD``, ``QKWATCH_H_STAR``), the default alert rules, the schedule's
default H*, the generated Prometheus rules and Grafana dashboards, the live page, ``qkwatch
report`` and ``qkwatch analyze``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

COLLAPSE_THRESHOLD = 0.70
"""Default QKAI above which a layer counts as collapsing."""
H_STAR = 0.85
"""Default target normalised attention entropy of the entropy-floor schedule."""
ENV = {"collapse": "QKWATCH_COLLAPSE_THRESHOLD", "h_star": "QKWATCH_H_STAR"}
"""The environment variable that sets each field."""


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
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Thresholds:
        """The defaults, each replaced by its environment variable where that is set.

        Raises:
            ValueError: naming the variable, for a value that is not a number in (0, 1).
        """
        environ = os.environ if environ is None else environ
        values: dict[str, float] = {}
        for name, variable in ENV.items():
            raw = environ.get(variable)
            if raw is None or not raw.strip():
                continue
            try:
                values[name] = float(raw)
            except ValueError:
                raise ValueError(f"{variable} must be a number, got {raw!r}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise ValueError(f"{ENV.get(name, name)}: {exc}") from None
