"""The PAR weights (lambdas) the trainer applies: the collector's, or the same schedule computed here.

Rank 0's poller thread offers what the collector serves, validated value by value so that an
operator's override is never silently lost: a vector of the wrong length cannot be mapped to
layers and is refused (the last good values stay); a value above ``lambda_max`` is clipped to it;
a non-finite or negative one gives way to the local schedule's value for that layer; every other
value applies. Each clip or refusal is logged once (per layer and requested value) and becomes an
event of the next report (``lambda_clipped``, ``lambda_invalid``, ``lambdas_refused``).

The collector's values are bounded in change as well as in value: after the first exchange, a layer's
lambda moves by at most ``lambda_max_change`` x ``lambda_max`` per exchange towards what the collector
serves (by default a quarter: from 0 to ``lambda_max`` takes four exchanges, 40 steps), so one forged
or mistaken answer cannot swing the training in one poll. Every change of a collector-sourced lambda
is recorded as a ``lambda_changed`` event (from, to, and what was requested when the bound held it
back); the local schedule, computed here, is not bounded. Every rank keeps
the running entropy of the layers it measures. On steps divisible by ``sync_every`` every rank
takes part in one small all-reduce on a CPU (gloo) group carrying rank 0's collector values and
each rank's local schedule for its own layers; all ranks then switch to the same values at the
same step. The exchange is chosen by the step number alone and carries whatever rank 0 last
fetched: no rank ever waits on the network.

Rank 0 reads the collector's lambdas once before the first step (``agent.lambdas.poller.fetch_first``,
which also creates the run) and then every ``lambda_poll_seconds`` from a ``LambdaPoller`` thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from qkwatch.agent.checks import SettingError, positive_ints, positive_seconds
from qkwatch.agent.lambdas.events import changed_event, describe, event, requested_value
from qkwatch.agent.lambdas.poller import LambdaPoller
from qkwatch.agent.shipping.transport import Transport
from qkwatch.contract.scheduling import ScheduleConfig, ema_update, entropy_floor
from qkwatch.contract.values import decode_value

logger = logging.getLogger(__name__)

LOCAL = -1.0
"""In the exchanged vector, a collector value that gave way to the local schedule (valid ones are >= 0)."""
MAX_CHANGE = 0.25
"""Default of ``lambda_max_change``: a collector lambda moves at most a quarter of lambda_max per exchange."""
MAX_VERSION = 2**53
"""Versions are exchanged as float64: above this they would not come back whole."""


@dataclass
class LambdasConfig:
    """How the lambdas are fetched, exchanged between ranks, and trusted."""

    lambda_sync_every: int = 10
    """Steps between lambda exchanges (all ranks switch to new lambdas at the same step)."""
    lambda_poll_seconds: float = 5.0
    """How often rank 0 asks the collector for lambdas, in the background."""
    lambda_stale_seconds: float = 120.0
    """Collector lambdas older than this fall back to the local schedule."""
    lambda_max_change: float = MAX_CHANGE
    """Most a collector lambda may move per exchange, as a fraction of ``lambda_max`` (0 < x <= 1; 1: unbounded)."""

    def __post_init__(self) -> None:
        positive_ints(self, "lambda_sync_every")
        positive_seconds(self, "lambda_poll_seconds", "lambda_stale_seconds")
        change = self.lambda_max_change
        if isinstance(change, bool) or not isinstance(change, (int, float)) or not 0 < change <= 1:
            raise SettingError("lambda_max_change", f"lambda_max_change must be in (0, 1], got {change!r}")

    def build(self, n_layers: int, schedule: ScheduleConfig, group: dist.ProcessGroup | None = None) -> Lambdas:
        return Lambdas(
            n_layers,
            schedule,
            sync_every=self.lambda_sync_every,
            stale_seconds=self.lambda_stale_seconds,
            group=group,
            max_change=float(self.lambda_max_change),
        )

    def poller(
        self,
        run_id: Callable[[], str | None],
        transports: Callable[[], Transport],
        offer: Callable[[dict[str, Any]], bool],
    ) -> LambdaPoller:
        """A poller (not started) offering what the collector serves for ``run_id()`` to ``offer``."""
        return LambdaPoller(run_id, transports, offer, self.lambda_poll_seconds)


class _Served(NamedTuple):
    """The collector's lambdas as last offered."""

    values: list[float]
    """Checked values, LOCAL where the local schedule applies."""
    version: int
    fetched_at: float
    """On the :attr:`Lambdas.clock`."""


class Lambdas:
    """The lambdas of every step, on every rank; see the module docstring."""

    def __init__(
        self,
        n_layers: int,
        schedule: ScheduleConfig,
        *,
        sync_every: int,
        stale_seconds: float,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_change: float = MAX_CHANGE,
    ):
        self.n_layers = n_layers
        self.max_change = max_change
        """Most a collector lambda moves per exchange, as a fraction of lambda_max."""
        self.schedule = schedule
        self.sync_every = sync_every
        self.stale_seconds = stale_seconds
        self.group = group
        self.clock = clock
        """Seconds on a monotonic clock: what the collector's values are stamped with and aged by."""
        self._lock = threading.Lock()
        self._collector: _Served | None = None
        self._noted: set[tuple[str, int | None, str]] = set()  # (kind, layer, repr(requested)) already warned about
        self._events: dict[str, list[dict[str, Any]]] = {}  # kind -> items, for the next report
        self._changes: dict[int, dict[str, Any]] = {}  # layer -> its change since the last report
        self._warned_limit = False
        self._entropy: list[float | None] = [None] * n_layers
        self.applied: list[float] = [0.0] * n_layers
        self.source = "local"
        self.version = -1
        self._synced_at: int | None = None

    # --- inputs -----------------------------------------------------------------------------

    def offer(self, answer: object, now: float | None = None) -> bool:
        """A ``GET /v1/runs/{id}/lambdas`` answer; True if taken (possibly with values clipped or replaced).

        Only a vector that cannot be mapped to the layers (not a list of ``n_layers``) is refused.
        """
        if not isinstance(answer, dict):
            self._refuse(answer)
            return False
        values = answer.get("lambdas")
        if not isinstance(values, list) or len(values) != self.n_layers:
            self._refuse(values)
            return False
        checked = [self._checked(layer, value) for layer, value in enumerate(values)]
        version = answer.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
            version = 0
        with self._lock:
            self._collector = _Served(checked, version, self.clock() if now is None else now)
        return True

    def has_events(self) -> bool:
        with self._lock:
            return bool(self._events or self._changes)

    def take_events(self) -> list[dict[str, Any]]:
        """Events about clipped, replaced or refused collector lambdas since the last call (for a report).

        One event per kind (the collector keeps one per run, attempt, step and kind), listing the layers.
        """
        with self._lock:
            pending, self._events = self._events, {}
            changes, self._changes = self._changes, {}
        events = [event(kind, items, _lambda_max(self.schedule)) for kind, items in pending.items()]
        if changes:
            events.append(changed_event([changes[layer] for layer in sorted(changes)]))
        return events

    def _checked(self, layer: int, value: Any) -> float:
        """The value to apply for ``layer``: as served, clipped to lambda_max, or LOCAL."""
        try:
            v = decode_value(value)
        except (TypeError, ValueError):
            v = None
        if v is None or not math.isfinite(v) or v < 0:
            self._note("lambda_invalid", layer, value, "local schedule")
            return LOCAL
        lambda_max = _lambda_max(self.schedule)
        if v > lambda_max:
            self._note("lambda_clipped", layer, v, lambda_max)
            return lambda_max
        return v

    def _refuse(self, values: Any) -> None:
        got = len(values) if isinstance(values, list) else type(values).__name__
        self._note("lambdas_refused", None, got, "last good values")

    def _note(self, kind: str, layer: int | None, requested: Any, applied: Any) -> None:
        """Warn once per (kind, layer, requested value) and queue it for the next report's events."""
        requested = requested_value(requested)
        key = (kind, layer, repr(requested))
        if key in self._noted:
            return
        self._noted.add(key)
        logger.warning("qkwatch: %s", describe(kind, layer, requested, applied, self.n_layers, self.schedule))
        item = (
            {"requested": requested, "applied": applied}
            if layer is None
            else {"layer": layer, "requested": requested, "applied": applied}
        )
        with self._lock:
            self._events.setdefault(kind, []).append(item)

    def observe(self, layer_entropy: dict[int, float]) -> None:
        """Running entropy of this rank's layers from a report (host floats)."""
        with self._lock:
            for layer, h in layer_entropy.items():
                if 0 <= layer < self.n_layers:
                    self._entropy[layer] = ema_update(self._entropy[layer], h, self.schedule)

    # --- output -----------------------------------------------------------------------------

    def current(self, step: int) -> list[float]:
        """The lambdas to apply at ``step``; changes only at exchange steps (and the first call)."""
        if self._synced_at is None or (step % self.sync_every == 0 and step != self._synced_at):
            self._exchange()
            self._synced_at = step
        return self.applied

    def _exchange(self) -> None:
        n = self.n_layers
        with self._lock:
            held = self._collector
            if held is not None and self.clock() - held.fetched_at > self.stale_seconds:
                held = None  # stale: the local schedule applies
            local = entropy_floor(self._entropy, self.schedule)
        fresh = held is not None
        collector = held.values if held is not None else [0.0] * n
        version = held.version if held is not None else -1
        own = [v if h is not None else 0.0 for v, h in zip(local, self._entropy, strict=True)]
        vec = torch.tensor([1.0 if fresh else 0.0, float(version), *collector, *own], dtype=torch.float64)
        if self.group is not None:
            if dist.get_rank(self.group) != 0:
                vec[: 2 + n] = 0.0  # only rank 0 speaks for the collector
            dist.all_reduce(vec, group=self.group)  # layers are owned by one rank each: the sum assembles them
        values = vec.tolist()
        local_all = values[2 + n :]
        if values[0] > 0:  # a value that gave way (LOCAL) takes the local schedule's, assembled above
            served = [lo if v == LOCAL else v for v, lo in zip(values[2 : 2 + n], local_all, strict=True)]
            if self._synced_at is not None:  # after the first exchange, collector values move at a bounded pace
                served = self._bounded(served)
            version = values[1]
            self.applied, self.source = served, "collector"
            self.version = int(version) if math.isfinite(version) and 0 <= version <= MAX_VERSION else 0
        else:
            self.applied, self.source, self.version = local_all, "local", -1

    def _bounded(self, served: list[float]) -> list[float]:
        """``served``, each value at most ``max_change`` x lambda_max from the last applied one; changes recorded."""
        step = self.max_change * _lambda_max(self.schedule)
        out: list[float] = []
        for layer, (want, was) in enumerate(zip(served, self.applied, strict=True)):
            got = min(max(want, was - step), was + step)
            out.append(got)
            if got != was:
                self._record_change(layer, was, got, want)
        return out

    def _record_change(self, layer: int, was: float, got: float, want: float) -> None:
        """Kept for the next report's ``lambda_changed`` event (rank 0's: it speaks for the collector)."""
        if self.group is not None and dist.get_rank(self.group) != 0:
            return
        if got != want and not self._warned_limit:
            self._warned_limit = True
            logger.warning(
                "qkwatch: the collector's lambda for layer %d moves from %r to %r; it is applied at most %g "
                "(lambda_max_change=%g x lambda_max) per exchange (further ones are recorded as events, not logged)",
                layer,
                was,
                want,
                self.max_change * _lambda_max(self.schedule),
                self.max_change,
            )
        with self._lock:
            item = self._changes.setdefault(layer, {"layer": layer, "from": was})
            item["to"] = got
            if got != want:
                item["requested"] = want
            else:
                item.pop("requested", None)

    def local_values(self) -> Sequence[float]:
        with self._lock:
            return entropy_floor(self._entropy, self.schedule)

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to apply the same lambdas: this rank's running entropies, the
        values applied since the last exchange and that exchange's step (plain JSON)."""
        with self._lock:
            return {"entropy": list(self._entropy), "applied": list(self.applied), "synced_at": self._synced_at}

    def load_state_dict(self, states: Sequence[dict[str, Any]]) -> None:
        """Restore from the states every rank saved (each knows the layers it measured; merged by layer).

        With the same world size every rank gets back exactly what it had; with another, each still
        gets every layer's running entropy. A state of another layer count is ignored.
        """
        states = [s for s in states if len(s.get("entropy", [])) == self.n_layers]
        if not states:
            return
        with self._lock:
            for layer in range(self.n_layers):
                known = [s["entropy"][layer] for s in states if s["entropy"][layer] is not None]
                self._entropy[layer] = known[0] if known else None
            self.applied = [float(v) for v in states[0]["applied"]]
            self._synced_at = states[0]["synced_at"]


def _lambda_max(schedule: ScheduleConfig) -> float:
    """``schedule.lambda_max``: typed optional, but ``ScheduleConfig.__post_init__`` always resolves it."""
    assert schedule.lambda_max is not None, "ScheduleConfig.__post_init__ resolves lambda_max"
    return schedule.lambda_max
