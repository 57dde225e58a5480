"""Entropy-floor scheduling of the RAA penalty weights (seed 000), pure Python.

    lambda_l = lambda_0 * sigmoid((H_l - H_star) / beta)

where ``H_l`` is layer l's running normalised attention entropy, an exponential moving average
over reports: ``H_l <- ema * H_l + (1 - ema) * h_new``, initialised with the first value. A layer
whose entropy drifts above the target (towards uniform attention, i.e. collapsing) gets the
stronger penalty. The collector serves these weights; the in-process agent imports this module
to compute the same formula locally when the collector is unreachable, so it must import nothing
but the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ScheduleConfig:
    """Parameters of the schedule; read from a run config's ``"schedule"`` object."""

    lambda_0: float = 0.1
    """Largest scheduled weight (the sigmoid's ceiling)."""
    h_star: float = 0.75
    """Target normalised entropy H*; at H_l = H* a layer gets lambda_0 / 2."""
    beta: float = 0.05
    """Temperature of the sigmoid, > 0; smaller is a sharper switch."""
    ema: float = 0.9
    """Weight of the previous running entropy in the EMA, in [0, 1)."""
    lambda_max: float = 1.0
    """Upper bound of any lambda, operator overrides included."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"schedule.{f.name} must be a finite number, got {value!r}")
        if self.beta <= 0:
            raise ValueError(f"schedule.beta must be > 0, got {self.beta!r}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"schedule.ema must be in [0, 1), got {self.ema!r}")
        if self.lambda_max < 0:
            raise ValueError(f"schedule.lambda_max must be >= 0, got {self.lambda_max!r}")
        if not 0 <= self.lambda_0 <= self.lambda_max:
            raise ValueError(f"schedule.lambda_0 must be in [0, lambda_max={self.lambda_max}], got {self.lambda_0!r}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> ScheduleConfig:
        """Build from a run config's ``"schedule"`` object; missing keys take the defaults.

        Raises:
            ValueError: naming the key, for an unknown key or an invalid value.
        """
        mapping = dict(mapping or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise ValueError(f"schedule.{unknown[0]} is not a schedule parameter (known: {', '.join(sorted(known))})")
        return cls(**mapping)


def sigmoid(x: float) -> float:
    """Numerically stable logistic function."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def entropy_floor(h: Sequence[float | None], cfg: ScheduleConfig) -> list[float]:
    """Scheduled lambda per layer from running entropies.

    Args:
        h: running normalised entropy H_l per layer, in [0, 1]; None (no evidence yet) or NaN
            gives 0 (no penalty before any evidence).
        cfg: schedule parameters.

    Returns:
        ``lambda_0 * sigmoid((H_l - H_star) / beta)`` per layer, each in [0, lambda_0].
    """
    out = []
    for value in h:
        if value is None or math.isnan(value):
            out.append(0.0)
        else:
            out.append(cfg.lambda_0 * sigmoid((value - cfg.h_star) / cfg.beta))
    return out


def ema_update(prev: float | None, new: float, cfg: ScheduleConfig) -> float:
    """One EMA step of a layer's running entropy; the first value initialises it.

    A non-finite ``new`` (a NaN entropy from a broken step) leaves ``prev`` unchanged, so one bad
    measurement cannot poison the running value for good.
    """
    if not math.isfinite(new):
        return prev if prev is not None else math.nan
    if prev is None or math.isnan(prev):
        return new
    return cfg.ema * prev + (1.0 - cfg.ema) * new


def apply_overrides(lambdas: Sequence[float], overrides: Mapping[int, float]) -> list[float]:
    """Scheduled lambdas with operator overrides (layer -> value) in place; out-of-range layers ignored."""
    out = list(lambdas)
    for layer, value in overrides.items():
        if 0 <= layer < len(out):
            out[layer] = value
    return out


def check_override(layer: int, value: float, cfg: ScheduleConfig, n_layers: int | None) -> None:
    """Raise ValueError naming the problem unless ``value`` is a valid override for ``layer``."""
    if n_layers is not None and not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is out of range: the run has {n_layers} layers")
    if layer < 0:
        raise ValueError(f"layer {layer} is negative")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"override for layer {layer} must be a finite number, got {value!r}")
    if not 0 <= value <= cfg.lambda_max:
        raise ValueError(f"override for layer {layer} must be in [0, lambda_max={cfg.lambda_max}], got {value!r}")
