"""The PAR weights (lambdas) the trainer applies: the collector's, or the same schedule computed here.

Rank 0's poller thread offers what the collector serves (validated: the right length, finite, in
``[0, lambda_max]``; anything else is refused and the last good values stay). Every rank keeps
the running entropy of the layers it measures. On steps divisible by ``sync_every`` every rank
takes part in one small all-reduce on a CPU (gloo) group carrying rank 0's collector values and
each rank's local schedule for its own layers; all ranks then switch to the same values at the
same step. The exchange is chosen by the step number alone and carries whatever rank 0 last
fetched: no rank ever waits on the network.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from monitor.scheduling import ScheduleConfig, ema_update, entropy_floor

SOURCES = ("collector", "local")


class Lambdas:
    def __init__(
        self,
        n_layers: int,
        schedule: ScheduleConfig,
        *,
        sync_every: int,
        stale_seconds: float,
        group: dist.ProcessGroup | None = None,
    ):
        self.n_layers = n_layers
        self.schedule = schedule
        self.sync_every = sync_every
        self.stale_seconds = stale_seconds
        self.group = group
        self._lock = threading.Lock()
        self._collector: tuple[list[float], int, float] | None = None  # values, version, fetched at
        self._entropy: list[float | None] = [None] * n_layers
        self.applied: list[float] = [0.0] * n_layers
        self.source = "local"
        self.version = -1
        self._synced_at: int | None = None

    # --- inputs -----------------------------------------------------------------------------

    def offer(self, answer: dict, now: float | None = None) -> bool:
        """A ``GET /v1/runs/{id}/lambdas`` answer; True if it was valid and taken."""
        values = answer.get("lambdas")
        if not isinstance(values, list) or len(values) != self.n_layers:
            return False
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            return False
        if not all(math.isfinite(v) and 0.0 <= v <= self.schedule.lambda_max for v in values):
            return False
        version = answer.get("version")
        with self._lock:
            self._collector = (
                values,
                int(version) if isinstance(version, int) else 0,
                time.monotonic() if now is None else now,
            )
        return True

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
            fresh = self._collector is not None and time.monotonic() - self._collector[2] <= self.stale_seconds
            collector = self._collector[0] if fresh else [0.0] * n
            version = self._collector[1] if fresh else -1
            local = entropy_floor(self._entropy, self.schedule)
        own = [v if h is not None else 0.0 for v, h in zip(local, self._entropy, strict=True)]
        vec = torch.tensor([1.0 if fresh else 0.0, float(version), *collector, *own], dtype=torch.float64)
        if self.group is not None:
            if dist.get_rank(self.group) != 0:
                vec[: 2 + n] = 0.0  # only rank 0 speaks for the collector
            dist.all_reduce(vec, group=self.group)  # layers are owned by one rank each: the sum assembles them
        values = vec.tolist()
        if values[0] > 0:
            self.applied, self.source, self.version = values[2 : 2 + n], "collector", int(values[1])
        else:
            self.applied, self.source, self.version = values[2 + n :], "local", -1

    def local_values(self) -> Sequence[float]:
        with self._lock:
            return entropy_floor(self._entropy, self.schedule)
