"""The in-process agent: what the training loop calls.

Per optimizer step the loop calls, in this order::

    agent.step(step)            # before the forward: arms the hooks on report steps
    lams = agent.lambdas()      # RAA only; on every rank every step, or never
    ... forward, backward, optimizer step ...
    agent.log(step, loss=loss)  # run-level scalars (tensors are fine: nothing is synchronised)
    agent.log_layers(step, {"lambda": lams, "par": par})
    ...
    agent.close(timeout=10)     # once; idempotent; also on exit via the context manager
                                # (status="finished"; "crashed" with a reason on an exception)

On a report step, ``step`` reads the weights (those the step's forward runs with: the optimizer
step before it applied, its own not yet) and the forward fills the probe; the next ``step`` call
(or ``close``) packs every value of the report into one tensor (``agent.assembly``, with
``agent.report``) and copies it to the host once. On the CPU the report is written to the spool
right there (a few microseconds, one ``write``); on a GPU a host-copy thread waits for the copy
and writes it (``agent.delivery``, with ``agent.host_copy``), so the step never waits for the
device. A sender thread delivers the spool (``agent.shipping.shipper``); the step never waits for the
network either.

The parts, each configured by its own section of :class:`qkwatch.agent.config.AgentConfig`: the probe
(``agent.probe``), the spool (``agent.shipping.disk_spool``), the sender, the lambdas and their poller
(``agent.lambdas``); the run's identity is ``agent.identity``'s, the health counters
``agent.health``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from qkwatch.agent.assembly import ReportAssembly
from qkwatch.agent.config import AgentConfig
from qkwatch.agent.health import DropNotes, Health, Overhead
from qkwatch.agent.host_copy import HostCopyWriter
from qkwatch.agent.identity import RunIdentity
from qkwatch.agent.lambdas.poller import fetch_first
from qkwatch.agent.models.adapters import Site, find_sites
from qkwatch.agent.models.layouts import Layout
from qkwatch.agent.probe.plan import Plan
from qkwatch.agent.shipping.forks import track as track_forks
from qkwatch.agent.shipping.transport import FaultLog, HttpTransport, transports
from qkwatch.agent.sinks.base import RunInfo
from qkwatch.contract.names import rank_suffix
from qkwatch.contract.values import clean_metric_name
from qkwatch.contract.wire import RunConfig

logger = logging.getLogger(__name__)

INITIAL_FETCH_SECONDS = 2.0
"""How long attach() may spend getting the run's lambdas before the first step (collector up)."""
MAX_LOGGED_STEPS = 256
"""At most this many steps of logged scalars wait for the next report; beyond, they ship on their own."""
END_STATUSES = ("finished", "crashed")
"""What ``close(status=...)`` may say about how the run ended (None: say nothing)."""


class Agent(ReportAssembly):
    """Measures, spools and ships; reads lambdas back. Build it with :func:`attach`.

    Its report of a step is assembled by :class:`~qkwatch.agent.assembly.ReportAssembly` and
    delivered to the spool by :class:`~qkwatch.agent.delivery.ReportDelivery`, its bases.
    """

    def __init__(self, model: nn.Module, cfg: AgentConfig, sites: list[Site]):
        self.cfg = cfg
        self.sites = sites
        self.n_layers = len(sites)
        shared = _distributed() if cfg.distributed is None else cfg.distributed and _distributed()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        run_config = RunConfig.model_validate({**cfg.config, "n_layers": self.n_layers})  # the collector's parser
        # Sent in full: the collector then schedules with exactly the parameters the local fallback
        # uses, whatever defaults (QKWATCH_H_STAR) either process was started with.
        sent = {**cfg.config, "n_layers": self.n_layers, "schedule": dataclasses.asdict(run_config.schedule)}
        self.identity = RunIdentity.agree(cfg.project, cfg.run, sent, self._group, tags=cfg.tags, notes=cfg.notes)
        self.owned = {s.layer for s in sites if s.layer % self.world == self.rank}
        self.sinks = cfg.sinking.build(RunInfo(cfg.project, self.run, self.n_layers, self.rank, self.world, sent))
        suffix = rank_suffix(self.rank, self.world)
        self.spool = cfg.spooling.open(Path(cfg.spool) / cfg.project / self.run / f"rank-{self.rank}")
        self.identity.claim(self.spool, url=cfg.url, rank=self.rank)
        self.lambdas_state = cfg.lambdas.build(self.n_layers, run_config.schedule, self._group)
        self.probe = cfg.probe.build(sites, self.owned)
        self.health = Health()
        self._faults = FaultLog()  # one warning per kind of collector fault, whichever thread meets it
        connect = transports(cfg.url, cfg.token, cfg.request_timeout, self._faults)
        self.sender = cfg.sender.build(self.spool, connect, health=self.health, name=f"qkwatch-sender-{self.rank}")
        sender = self.sender
        self.poller = (
            cfg.lambdas.poller(lambda: sender.run_id, connect, self.lambdas_state.offer)
            if self.rank == 0 and cfg.url
            else None
        )
        self._pid = os.getpid()
        self._closed = False
        self._inert = False
        self._step = 0
        self._stepped: int | None = None  # the step last given to step(): a repeat does nothing
        self._plan: Plan | None = None
        self._plan_time = 0.0
        self._first_report = True
        self._logged: dict[int, dict[str, float | Tensor]] = {}  # step -> scalars logged at it
        self._logged_at: dict[int, float] = {}  # step -> when it was first logged
        self._renamed: set[str] = set()  # metric names already warned about
        self._layer_values: dict[str, tuple[int, Any]] = {}
        self._applied: dict[int, list[float]] = {}
        self._overhead = Overhead()
        self._suffix = suffix
        self._drops = DropNotes(self.spool.dropped, suffix)
        self._host_copy: HostCopyWriter | None = None
        if self.rank == 0 and cfg.url:
            self._fetch_first_lambdas(cfg.url)
        self.sender.start()
        if self.poller is not None:
            self.poller.start()
        track_forks(self)

    @property
    def run(self) -> str:
        """The run's name."""
        return self.identity.name

    # --- the training loop's calls -----------------------------------------------------------

    def step(self, step: int) -> None:
        """Tell the agent the optimizer step about to run (before its forward).

        On a step whose weights are due it reads them here: the report of ``step`` carries the
        weights its forward runs with (after ``step`` optimizer updates; at step 0, the initial ones).

        Calling it again with the same step does nothing, so a loop that accumulates gradients may
        call it before every micro-batch with the number of optimizer steps done (Accelerate's
        ``accumulate()``): the step's first micro-batch is measured, once.
        """
        if self._skip() or step == self._stepped:
            return
        self._stepped = step
        start = time.perf_counter()
        if self._plan is not None:
            self._finish_report()
        cfg = self.cfg
        assert cfg.weight_every is not None and cfg.spectra_every is not None, "AgentConfig.__post_init__ sets them"
        plan = Plan.at(step, every=cfg.every, weight_every=cfg.weight_every, spectra_every=cfg.spectra_every)
        self._step = step
        if plan.any:
            self._plan, self._plan_time = plan, time.time()
            self.probe.arm(plan)
        elif len(self._logged) >= MAX_LOGGED_STEPS:
            self._flush_logged()
        self._overhead.add(time.perf_counter() - start, step=True)

    def lambdas(self) -> list[float] | None:
        """Per-layer PAR weights for the current step; never waits on the network.

        Call it on every rank at every step (or never): on steps divisible by
        ``lambda_sync_every`` the ranks exchange values in one small collective.
        """
        if self._skip():
            return None
        start = time.perf_counter()
        values = self.lambdas_state.current(self._step)
        self._applied[self._step] = values
        if len(self._applied) > 4:
            self._applied.pop(next(iter(self._applied)))
        self._overhead.add(time.perf_counter() - start)
        return list(values)

    def log(self, step: int, **scalars: float | Tensor) -> None:
        """Run-level values (loss, lr, eval results), every one stored at ``step``.

        Tensors stay where they are until the next report, which copies them to the host with its
        own values (no synchronisation here); a step without a report becomes a report of its own
        holding only these scalars. Logging a name twice at one step keeps the last value.
        """
        if self._skip() or self.rank != 0:
            return
        logged = self._logged.get(step)
        if logged is None:
            logged = self._logged[step] = {}
            self._logged_at[step] = time.time()
        for name, value in scalars.items():
            logged[self._metric_name(name)] = value.detach() if isinstance(value, Tensor) else value

    def log_layers(self, step: int, values: dict[str, Any]) -> None:
        """Per-layer values (e.g. ``{"lambda": [...], "par": tensor}``) for the report of ``step``."""
        if self._skip() or self.rank != 0:
            return
        for name, value in values.items():
            self._layer_values[self._metric_name(name)] = (step, value.detach() if isinstance(value, Tensor) else value)

    def _metric_name(self, name: str) -> str:
        """``name`` as the collector accepts it; a name it would refuse (and with it the whole batch
        of reports) is cleaned, with a warning the first time."""
        cleaned = clean_metric_name(name)
        if cleaned != name and name not in self._renamed:
            self._renamed.add(name)
            logger.warning("qkwatch: metric %r is stored as %r (names are letters, digits and _.:/-)", name, cleaned)
        return cleaned

    def close(self, timeout: float = 10.0, *, status: str | None = "finished", reason: str | None = None) -> None:
        """Finish the last report, say how the run ended, deliver what can be delivered within ``timeout``.

        Idempotent. Returns within ``timeout`` (plus a few milliseconds) even when the collector is
        down; what is not delivered stays in the spool for the next run or ``qkwatch sync``.

        Args:
            timeout: seconds to spend delivering.
            status: "finished" (said by rank 0 only: the job is done when rank 0 is), "crashed" (any
                rank: its own exception, a preemption), or None to leave the run's status alone. It is
                spooled after the last report and sent after it, so it is never lost and never
                overtaken by a report.
            reason: why, stored as the run's ``status_reason`` (cut to 200 characters).

        Raises:
            ValueError: an unknown status.
        """
        if status is not None and status not in END_STATUSES:
            raise ValueError(f"close(status={status!r}): status must be one of {END_STATUSES} or None")
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            if self._plan is not None or self._logged or self._layer_values or self.lambdas_state.has_events():
                self._finish_report()
        finally:
            self.probe.close()
            self._spool_status(status, reason, deadline)
            if self._host_copy is not None:
                self._host_copy.close(max(0.0, deadline - time.monotonic()))
            if self.sinks is not None:
                self.sinks.stop()  # the sinks write what they hold while the sender delivers
            if self.poller is not None:
                self.poller.close(0.1)
            # offline (no URL) nothing can be delivered: do not spend the timeout trying
            finished = self.sender.close(max(0.0, deadline - time.monotonic()) if self.cfg.url else 0.0)
            if finished:
                self.spool.close()
            if self.sinks is not None:
                self.sinks.close(max(0.0, deadline - time.monotonic()))
            left = self.spool.bytes_pending() if finished else None
            if not finished and self.cfg.url:
                logger.warning(
                    "qkwatch: the collector had not taken every report when close()'s timeout ran out (%d of %d "
                    "acknowledged); the rest stay in %s (delivered on the next run, or by `qkwatch sync %s`)",
                    self.health.acked,
                    self.health.written,
                    self.spool.path,
                    self.spool.path,
                )
            if left:  # collector-free with sinks: nothing is missing, the spool only keeps them for later
                logger.log(
                    logging.WARNING if self.cfg.url or self.sinks is None else logging.INFO,
                    "qkwatch: %d bytes of reports not delivered yet; they stay in %s "
                    "(delivered on the next run, or by `qkwatch sync %s`)",
                    left,
                    self.spool.path,
                    self.spool.path,
                )

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """A ``with`` block that raises marks the run crashed, with the exception as the reason."""
        if exc is None:
            self.close()
        else:
            self.close(status="crashed", reason=exception_reason(exc))

    @property
    def spool_path(self) -> Path:
        return self.spool.path

    def state_dict(self) -> dict[str, Any]:
        """This rank's state a resumed run needs (the local schedule's), as plain JSON.

        Called where the trainer checkpoints, after the step's forward: the report of that step is
        finished first, so its entropies are in the state as they would be in an uninterrupted run.
        """
        if self._plan is not None and not self._skip():
            self._finish_report()
        return {"lambdas": self.lambdas_state.state_dict()}

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Restore from what every rank's :meth:`state_dict` returned at the checkpoint."""
        self.lambdas_state.load_state_dict([s["lambdas"] for s in states if "lambdas" in s])

    @property
    def lambda_source(self) -> str:
        """Where the lambdas of the current step come from: "collector", or "local" (the agent's own schedule)."""
        return self.lambdas_state.source

    def after_fork_in_child(self) -> None:
        """In a forked child (a DataLoader worker): threads did not survive, the spool is the parent's."""
        self._inert = True

    # --- setup --------------------------------------------------------------------------------

    def _fetch_first_lambdas(self, url: str) -> None:
        """Before the first step: create the run and read its lambdas if the collector answers fast.

        Both requests together end within INITIAL_FETCH_SECONDS, whatever the collector does.
        """
        until = time.monotonic() + INITIAL_FETCH_SECONDS
        transport = HttpTransport(url, self.cfg.token, INITIAL_FETCH_SECONDS, until=until, faults=self._faults)
        try:
            run_id = fetch_first(transport, self.identity, self.lambdas_state.offer)
        finally:
            transport.close()
        if run_id is not None:
            self.sender.run_id = run_id

    def _skip(self) -> bool:
        if self._inert or self._closed:
            return True
        if os.getpid() != self._pid:  # a forked DataLoader worker: leave the parent's agent alone
            self._inert = True
            return True
        return False


def attach(
    model: nn.Module,
    *,
    url: str | None = None,
    token: str | None = None,
    project: str | None = None,
    run: str | None = None,
    spool: str | None = None,
    every: int | None = None,
    config: dict[str, Any] | None = None,
    tags: Iterable[str] | str | None = None,
    notes: str | None = None,
    layout: Layout | None = None,
    mapping: Layout | None = None,
    **settings: Any,
) -> Agent:
    """Attach the agent to ``model`` (any supported transformer, FSDP2-sharded or not).

    Settings resolve as: the argument, then the environment (``QKWATCH_URL``, ``QKWATCH_TOKEN``,
    ``QKWATCH_PROJECT``, ``QKWATCH_RUN``, ``QKWATCH_SPOOL``, ``QKWATCH_EVERY``, ``QKWATCH_TAGS``,
    ``QKWATCH_NOTES``, ``QKWATCH_SINKS``), then the default (see :class:`qkwatch.agent.config.AgentConfig` for every
    setting). With FSDP2, call it on every rank after ``fully_shard``; each rank measures
    ``layer % world == rank``. ``layout`` names the query and key projections of a model no adapter
    knows (``mapping`` is its older name).

    ``tags`` (``["baseline", "lr=3e-4"]``, or ``"baseline,lr=3e-4"``) are added to the run's tags; a
    resume never removes one. ``notes`` (free text) are stored when the run has none yet; a resume
    keeps notes already set. ``qkwatch runs tag/untag/note`` and ``PATCH /v1/runs/{id}`` change both.

    ``sinks=["tensorboard", "wandb", "mlflow", <a qkwatch.agent.sinks.base.Sink>]`` also sends every
    report there, from a thread of its own (``qkwatch.agent.sinks``); with no ``url`` they are the only
    destination, and the spool still keeps every report for ``qkwatch sync``.

    Raises:
        ValueError: a bad setting (named). agent.models.adapters.AdapterError: no attention found.
    """
    cfg = AgentConfig.resolve(
        url=url,
        token=token,
        project=project,
        run=run,
        spool=spool,
        every=every,
        config=config,
        tags=tags,
        notes=notes,
        **settings,
    )
    sites = find_sites(model, layout or mapping)
    return Agent(model, cfg, sites)


# --- helpers ------------------------------------------------------------------------------------


def exception_reason(exc: BaseException) -> str:
    """``"RuntimeError: <message>"`` (first line), the status reason of a run that raised."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
