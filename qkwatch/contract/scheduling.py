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
from dataclasses import dataclass, field, fields
from typing import Any

from qkwatch.contract.thresholds import Thresholds


@dataclass(frozen=True)
class ScheduleConfig:
    """Parameters of the entropy-floor schedule: the one definition, with the one set of defaults.

    The collector reads them from a run config's ``"schedule"`` object; the trainer holds them as
    ``raa.schedule`` and sends them in that object; the agent's local schedule uses the same ones.
    Seed 000 gives no values for any of them, so the defaults are reasoned from what it does report:

    * ``h_star`` (0.85) lies midway between the normalised mid-layer entropy of seed 000's collapsed
      vanilla model (0.94) and of the same layers kept healthy by RAA (0.71-0.76).
    * ``beta`` (0.04) makes that split sharp: a healthy layer at 0.76 gets ``sigmoid(-2.25)`` =
      0.095 ``lambda_0`` (at most a tenth), a collapsed one at 0.94 gets 0.905 ``lambda_0``.
    * ``ema`` (0.8): the running entropy follows a drift within about 5 reports (time constant
      ``1 / (1 - ema)``) while averaging the report-to-report noise of the sampled rows (a standard
      deviation of 0.02-0.03 on the trained collapse_cpu model with the agent's 4 sequences of 64
      rows) down by ``sqrt((1 - ema) / (1 + ema))`` = 1/3, well inside ``beta``.
    * ``lambda_0`` (1e-4) is sized so that PAR of a layer at the alert threshold is about one nat,
      the scale of the language-model loss: every head at QKAI 0.70 is an excess of ``0.25 r`` over
      ``tau = 0.45 r``, so ``lambda_0 = 1 / (n_heads (0.25 r)^2)``; for seed 000's 1.3B model (16
      heads, r = 128) that is 6e-5, rounded to 1e-4. Small models set their own the same way.
    * ``lambda_max`` (by default a hundred times ``lambda_0``) bounds every lambda, operator overrides
      included: room to lean hard on one layer without letting a typo swamp the loss.
    * ``floor`` (0.1): PAR is computed only on layers whose lambda exceeds a tenth of ``lambda_0``
      (the "flagged" layers); below that the penalty would be too weak to matter, and skipping it
      is where scheduling saves its time (seed 000: 9 % overhead down to 3 %).
    """

    lambda_0: float = 1e-4
    """Largest scheduled weight (the sigmoid's ceiling)."""
    h_star: float = field(default_factory=lambda: Thresholds.from_env().h_star)  # QKWATCH_H_STAR, else H_STAR
    """Target normalised entropy H*; at H_l = H* a layer gets lambda_0 / 2."""
    beta: float = 0.04
    """Temperature of the sigmoid, > 0; smaller is a sharper switch."""
    ema: float = 0.8
    """Weight of the previous running entropy in the EMA, in [0, 1)."""
    lambda_max: float | None = None
    """Upper bound of any lambda, operator overrides included; None: 100 x lambda_0."""
    floor: float = 0.1
    """A layer is flagged (PAR computed) when its lambda exceeds floor * lambda_0; in [0, 1)."""

    def __post_init__(self) -> None:
        if self.lambda_max is None and _number(self.lambda_0):
            object.__setattr__(self, "lambda_max", 100.0 * self.lambda_0)  # frozen: set once, here
        for f in fields(self):
            value = getattr(self, f.name)
            if not _number(value):
                raise ValueError(f"schedule.{f.name} must be a finite number, got {_show(value)}")
        assert self.lambda_max is not None  # resolved above; the loop refuses a None
        if self.beta <= 0:
            raise ValueError(f"schedule.beta must be > 0, got {self.beta!r}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"schedule.ema must be in [0, 1), got {self.ema!r}")
        if self.lambda_max < 0:
            raise ValueError(f"schedule.lambda_max must be >= 0, got {self.lambda_max!r}")
        if not 0 <= self.lambda_0 <= self.lambda_max:
            raise ValueError(f"schedule.lambda_0 must be in [0, lambda_max={self.lambda_max}], got {self.lambda_0!r}")
        if not 0 <= self.floor < 1:
            raise ValueError(f"schedule.floor must be in [0, 1), got {self.floor!r}")

    def flagged(self, lambdas: Sequence[float]) -> list[bool]:
        """Which layers carry PAR: ``lambda_l > floor * lambda_0``."""
        return [value > self.floor * self.lambda_0 for value in lambdas]

    @classmethod
    def from_mapping(cls, mapping: object) -> ScheduleConfig:
        """Build from a run config's ``"schedule"`` object; None or missing keys take the defaults.

        The one parser of that object: the collector's wire schema, the store (configs stored
        before the wire checked them) and the trainer's config files all come through here. A
        parameter is a JSON number, taken as a float; a boolean, a string or an integer too large
        for a float is refused, and only ``lambda_max`` may be null (its default).

        Raises:
            ValueError: naming the key (``schedule.<key>``), for an unknown key or an invalid value.
        """
        if mapping is None:
            return cls()
        if not isinstance(mapping, Mapping):
            raise ValueError(f"schedule must be an object of schedule parameters, got {_show(mapping)}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in mapping if key not in known)
        if unknown:
            raise ValueError(f"schedule.{unknown[0]} is not a schedule parameter (known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {key: _parameter(key, value) for key, value in mapping.items()}
        return cls(**values)


def _parameter(key: str, value: Any) -> float | None:
    """One schedule parameter as a float (None: ``lambda_max``'s default); ValueError names the key."""
    if value is None and key == "lambda_max":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"schedule.{key} must be a number, got {_show(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"schedule.{key} must be a finite number, got {_show(value)}") from None


def _number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _show(value: Any) -> str:
    """``repr`` for an error message, short: a huge int (its repr may even be refused) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


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
    if not _number(value):
        raise ValueError(f"override for layer {layer} must be a finite number, got {_show(value)}")
    assert cfg.lambda_max is not None  # __post_init__ resolves it
    if not 0 <= value <= cfg.lambda_max:
        raise ValueError(f"override for layer {layer} must be in [0, lambda_max={cfg.lambda_max}], got {value!r}")
