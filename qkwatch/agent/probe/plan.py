"""What a report step measures (:class:`Plan`) and what the probe captured of it (:class:`Capture`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class Plan:
    """What this report step measures."""

    step: int
    weights: bool = False
    spectra: bool = False
    activations: bool = False

    @classmethod
    def at(cls, step: int, *, every: int, weight_every: int, spectra_every: int) -> Plan:
        """What ``step`` measures at these cadences (a cadence of 0 never comes due)."""
        return cls(
            step,
            weights=_due(step, weight_every),
            spectra=_due(step, spectra_every),
            activations=_due(step, every),
        )

    @property
    def any(self) -> bool:
        return self.weights or self.activations


@dataclass
class Capture:
    """One report step's device-side results: layer -> metric -> 0-d tensor (and per-head)."""

    layers: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    heads: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    forward_seen: set[int] = field(default_factory=set)
    weights_seen: set[int] = field(default_factory=set)
    activations_seen: set[int] = field(default_factory=set)


Measured = tuple[dict[str, Tensor], dict[str, Tensor]]
"""One layer's measurement: per-layer values (0-d) and per-head ones (``(n_heads,)``, with ``heads``)."""


def _due(step: int, every: int) -> bool:
    return bool(every) and step % every == 0
