"""Assembly of the agent's report at a step: every value of it packed into one tensor.

On a report step the probe reads the weights when the step is armed (before its forward: the
weights the forward runs with) and the forward fills it with the activations; the next ``step`` call (or ``close``, or
``state_dict``) finishes the report on the training thread: the probe's capture, the run-level
scalars logged at that step (and any earlier step still waiting), the per-layer values logged for
it, the lambdas applied at it, the agent's health counters and its events (clipped or refused
lambdas, layers the probe never saw) go into one :class:`qkwatch.agent.report.Packer`, whose single
tensor is then handed to delivery (``agent.delivery``) for its one copy to the host. Scalars logged
over many steps without a report ship on their own, so what waits stays bounded.

:class:`ReportAssembly` is the part of :class:`qkwatch.agent.agent.Agent` that does this; the
agent's constructor sets the state it uses.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import Tensor

from qkwatch.agent.delivery import ReportDelivery
from qkwatch.agent.health import Overhead, health_scalars
from qkwatch.agent.models.adapters import Site
from qkwatch.agent.probe.plan import Capture, Plan
from qkwatch.agent.probe.probe import Probe
from qkwatch.agent.report import Packer, missing_layers_event

logger = logging.getLogger(__name__)


class ReportAssembly(ReportDelivery):
    """Packs the report of a step and ships it (a base of ``Agent``)."""

    # set by Agent.__init__
    sites: list[Site]
    world: int
    probe: Probe
    _closed: bool
    _step: int
    _plan: Plan | None
    _plan_time: float
    _first_report: bool
    _logged: dict[int, dict[str, float | Tensor]]
    _logged_at: dict[int, float]
    _layer_values: dict[str, tuple[int, Any]]
    _applied: dict[int, list[float]]
    _overhead: Overhead
    _suffix: str

    def _finish_report(self) -> None:
        """Pack the report of the planned step (training thread) and start its copy to the host."""
        plan = self._plan or Plan(self._step)
        capture = self.probe.disarm()  # its weights were read when the step was armed, before its forward
        self._plan = None
        packer = Packer()
        packer.metrics(capture.layers, capture.heads)
        for name, value in self._logged.pop(plan.step, {}).items():
            packer.scalar(name, value)
        self._logged_at.pop(plan.step, None)
        self._pack_logged(packer)
        for name, value in self._take_logged(self._layer_values, plan.step):
            packer.layer_values(name, value)
        if self.rank == 0 and plan.step in self._applied and not packer.has_layer_values("lambda"):
            packer.layer_values("lambda", self._applied[plan.step])
        for name, value in self._health_scalars().items():
            packer.scalar(name, value)
        self._ship(packer.pack(plan.step, self._plan_time or time.time(), self._events(plan, capture)))

    def _flush_logged(self) -> None:
        """Ship the scalars of many steps without a report (a long report cadence), bounding what waits."""
        packer = Packer()
        self._pack_logged(packer)
        self._ship(packer.pack(self._step, time.time(), [], main=False))

    def _pack_logged(self, packer: Packer) -> None:
        """Every step's logged scalars that have not gone yet, each for a report of its own step."""
        for step, scalars in self._logged.items():
            packer.logged(step, self._logged_at.get(step, time.time()), scalars)
        self._logged.clear()
        self._logged_at.clear()

    def _take_logged(self, logged: dict[str, tuple[int, Any]], step: int) -> list[tuple[str, Any]]:
        """The values logged for ``step`` (at close: every value left), taken out of ``logged``."""
        taken = []
        for name, (logged_step, value) in list(logged.items()):
            if logged_step == step or self._closed:
                del logged[name]
                taken.append((name, value))
        return taken

    def _health_scalars(self) -> dict[str, float]:
        out = health_scalars(
            self.health,
            spool_bytes=self.spool.bytes_pending(),
            overhead=self._overhead.take_mean(),
            suffix=self._suffix,
        )
        if self.rank == 0:
            out["lambda_source"] = 0.0 if self.lambdas_state.source == "collector" else 1.0
            out["lambda_version"] = float(self.lambdas_state.version)
        return out

    def _events(self, plan: Plan, capture: Capture) -> list[dict[str, Any]]:
        events = self.lambdas_state.take_events()  # clipped or refused collector lambdas (rank 0 fetches)
        if self._first_report and (plan.weights or plan.activations):
            self._first_report = False
            missing = sorted(
                (set(self.owned) - capture.weights_seen if plan.weights else set())
                | (set(self.owned) - capture.activations_seen if plan.activations else set())
            )
            if missing:
                names = [self.sites[i].name for i in missing]
                event = missing_layers_event(missing, names, self.rank, self.world, plan.step)
                logger.warning("qkwatch: %s", event["message"])
                events.append(event)
        return events
