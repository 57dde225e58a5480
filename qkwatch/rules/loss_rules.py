"""Loss-only alert rules: what a user who watches only the training loss can write in any tracker (pure).

A detector earns its place by warning earlier than these, on a recipe nobody tuned anything on
(issue 40). Each rule reads only the logged training loss (ascending steps, one value each), smoothed
by a trailing mean over ``window`` logged values (:func:`qkwatch.client.outcomes.smoothed`), and
fires at most once; :meth:`LossRule.first_firing` is the step it fires at, or None. Five kinds:

* ``level``: at step ``at`` (the first logged step at or after it) the smoothed loss is above
  ``above`` nats. A loss level means something on one recipe only.
* ``fall``: at step ``at`` the smoothed loss has fallen from the first logged loss ``L_0`` (about
  ln(vocabulary) at initialisation) by less than ``fraction`` x ``L_0``: relative, so that it may carry
  over to another recipe.
* ``rise``: the smoothed loss stays at least ``rise`` nats above its running minimum for
  ``for_steps`` logged values running; it fires at the last of them (when a live alert would know).
* ``plateau``: between step ``start`` and ``until`` x the run's planned steps, the smoothed loss fell
  by less than ``drop`` nats over its last ``span`` logged values.
* ``slope``: from step ``start`` on, the least-squares slope of the smoothed loss over its last
  ``span`` logged values is above ``per_100`` nats per 100 steps (a rising loss).

Every kind fires at the first non-finite loss, if nothing fired before: a NaN is visible to anyone.

A rule is written ``kind:key=value,...``, e.g. ``level:at=50,above=3.3`` (:meth:`LossRule.parse`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

KINDS: dict[str, dict[str, type]] = {
    "level": {"at": int, "above": float},
    "fall": {"at": int, "fraction": float},
    "rise": {"rise": float, "for_steps": int},
    "plateau": {"span": int, "drop": float, "start": int, "until": float},
    "slope": {"span": int, "per_100": float, "start": int},
}
"""Each kind's own keys (every kind also takes ``window``, the smoothing, 20 logged values by default)."""
WINDOW = 20


@dataclass(frozen=True)
class LossRule:
    """One loss-only alert (see the module docstring for what each kind means)."""

    kind: str
    params: Mapping[str, float] = field(default_factory=dict)
    window: int = WINDOW

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss rule kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        want = KINDS[self.kind]
        if set(self.params) != set(want):
            missing = sorted(set(want) - set(self.params))
            extra = sorted(set(self.params) - set(want))
            what = f"needs {', '.join(missing)}" if missing else f"takes no {', '.join(extra)}"
            raise ValueError(f"loss rule {self.kind}: {what} (keys: {', '.join(want)})")
        for key, value in self.params.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"loss rule {self.kind}: {key} must be a finite number, got {value!r}")
            low = 0 if key == "start" else 1
            if want[key] is int and (value != int(value) or value < low):
                raise ValueError(f"loss rule {self.kind}: {key} must be a whole number >= {low}, got {value!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"loss rule {self.kind}: window must be a whole number >= 1, got {self.window!r}")

    @classmethod
    def parse(cls, text: str) -> LossRule:
        """``kind:key=value,...`` (``window=`` optional); ValueError names what is wrong."""
        kind, _, rest = text.strip().partition(":")
        params: dict[str, float] = {}
        window = WINDOW
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, raw = part.partition("=")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"loss rule {text!r}: {key}={raw!r} is not a number") from None
            if not sep:
                raise ValueError(f"loss rule {text!r}: expected key=value, got {part!r}")
            if key == "window":
                if value != int(value):
                    raise ValueError(f"loss rule {text!r}: window must be a whole number")
                window = int(value)
            else:
                params[key] = int(value) if KINDS.get(kind, {}).get(key) is int and value == int(value) else value
        return cls(kind, params, window)

    def text(self) -> str:
        """The rule as :meth:`parse` reads it."""
        keys = ",".join(f"{k}={self.params[k]:g}" for k in KINDS[self.kind])
        return f"{self.kind}:{keys}" + ("" if self.window == WINDOW else f",window={self.window}")

    def describe(self) -> str:
        p = self.params
        smooth = f"the loss smoothed over {self.window} steps"
        return {
            "level": lambda: f"{smooth} above {p['above']:g} at step {p['at']:g}",
            "fall": lambda: f"{smooth} less than {p['fraction']:g} x the first loss below it at step {p['at']:g}",
            "rise": lambda: f"{smooth} {p['rise']:g} above its minimum for {p['for_steps']:g} steps",
            "plateau": lambda: (
                f"{smooth} fell less than {p['drop']:g} in {p['span']:g} steps, from step "
                f"{p['start']:g} to {p['until']:g} of the run"
            ),
            "slope": lambda: (
                f"{smooth} rising faster than {p['per_100']:g} nats per 100 steps over {p['span']:g} "
                f"steps, from step {p['start']:g}"
            ),
        }[self.kind]() + "; or a non-finite loss"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)["params"], "window": self.window, "text": self.text()}

    def first_firing(self, steps: Sequence[int], losses: Sequence[float], total_steps: int) -> int | None:
        """The first logged step at which the rule fires; None when it never does.

        ``total_steps`` is the run's planned length (``plateau``'s ``until`` is a fraction of it).

        Raises:
            ValueError: the two sequences differ in length.
        """
        if len(steps) != len(losses):
            raise ValueError(f"{len(steps)} steps but {len(losses)} losses")
        return LossSeries(steps, losses).first_firing(self, total_steps)


class LossSeries:
    """One run's loss, prepared once for many rules (the smoothing is computed once per window)."""

    def __init__(self, steps: Sequence[int], losses: Sequence[float]) -> None:
        self.steps = np.asarray(steps, dtype=np.int64)
        self.losses = np.asarray(losses, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(self.losses))
        self.nonfinite: int | None = int(bad[0]) if len(bad) else None
        """Index of the first non-finite loss."""
        self._smooth: dict[int, np.ndarray] = {}

    def smoothed(self, window: int) -> np.ndarray:
        """Trailing means over ``window`` values, up to the first non-finite loss (which ends the series)."""
        if window not in self._smooth:
            x = self.losses[: self.nonfinite]
            total = np.cumsum(x)
            out = total.copy()
            out[window:] -= total[:-window]
            self._smooth[window] = out / np.minimum(np.arange(1, len(x) + 1), window)
        return self._smooth[window]

    def first_firing(self, rule: LossRule, total_steps: int) -> int | None:
        """:meth:`LossRule.first_firing` on this series."""
        s = self.smoothed(rule.window)
        index = _FIRST[rule.kind](s, self.steps[: len(s)], self.losses, rule.params, total_steps) if len(s) else None
        found = [i for i in (index, self.nonfinite) if i is not None]
        return int(self.steps[min(found)]) if found else None


def _at(steps: np.ndarray, at: float) -> int | None:
    i = int(np.searchsorted(steps, at))
    return i if i < len(steps) else None


def _level(s: np.ndarray, steps: np.ndarray, losses: np.ndarray, p: Mapping[str, float], total: int) -> int | None:
    i = _at(steps, p["at"])
    return i if i is not None and s[i] > p["above"] else None


def _fall(s: np.ndarray, steps: np.ndarray, losses: np.ndarray, p: Mapping[str, float], total: int) -> int | None:
    i = _at(steps, p["at"])
    return i if i is not None and losses[0] - s[i] < p["fraction"] * losses[0] else None


def _rise(s: np.ndarray, steps: np.ndarray, losses: np.ndarray, p: Mapping[str, float], total: int) -> int | None:
    above = s >= np.minimum.accumulate(s) + p["rise"]
    n = int(p["for_steps"])
    if n == 1:
        held = above
    else:  # held for n values running, at the last of them: a window sum of the indicator
        count = np.cumsum(above, dtype=np.int64)
        held = np.zeros_like(above)
        held[n - 1 :] = (count[n - 1 :] - np.concatenate([[0], count[:-n]])) == n
    hits = np.flatnonzero(held)
    return int(hits[0]) if len(hits) else None


def _plateau(s: np.ndarray, steps: np.ndarray, losses: np.ndarray, p: Mapping[str, float], total: int) -> int | None:
    span = int(p["span"])
    if len(s) <= span:
        return None
    i = np.arange(span, len(s))
    ok = (steps[i] >= p["start"]) & (steps[i] <= p["until"] * total) & (s[i - span] - s[i] < p["drop"])
    hits = i[ok]
    return int(hits[0]) if len(hits) else None


def _slope(s: np.ndarray, steps: np.ndarray, losses: np.ndarray, p: Mapping[str, float], total: int) -> int | None:
    span = int(p["span"])
    if len(s) < span or span < 2:
        return None
    x = steps.astype(np.float64)

    # least-squares slope over each trailing window of span values, from running sums
    def windowed(v: np.ndarray) -> np.ndarray:
        c: np.ndarray = np.concatenate([[0.0], np.cumsum(v)])
        out: np.ndarray = c[span:] - c[:-span]
        return out

    sx, sy, sxx, sxy = windowed(x), windowed(s), windowed(x * x), windowed(x * s)
    slope = (span * sxy - sx * sy) / (span * sxx - sx * sx)
    end = np.arange(span - 1, len(s))
    hits = end[(steps[end] >= p["start"]) & (slope * 100 > p["per_100"])]
    return int(hits[0]) if len(hits) else None


_FIRST = {"level": _level, "fall": _fall, "rise": _rise, "plateau": _plateau, "slope": _slope}


TUNED_BASELINE = LossRule("level", {"at": 300, "above": 2.15})
"""The loss-only alert the instability suite tuned on its tune recipe (issue 40; ``experiments/results/
yardstick_tuned.json``): of every loss rule searched, the earliest that flags 80 % of the tune recipe's
hot-side bad runs with no alarm on a healthy one. It is the yardstick of ``qkwatch alerts backtest``'s lead
over the loss. A loss level belongs to its recipe: on another, give one tuned on it (``--loss-alert``)."""
