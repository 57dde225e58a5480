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

On a report step, the forward fills the probe; the next ``step`` call (or ``close``) stacks
every scalar of the report into one tensor and copies it to the host once. On the CPU the
report is written to the spool right there (a few microseconds, one ``write``); on a GPU a
spooler thread waits for the copy and writes it, so the step never waits for the device. A
sender thread delivers the spool; the step never waits for the network either.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from agent.adapters import Mapping, Site, find_sites
from agent.config import AgentConfig
from agent.lambdas import Lambdas
from agent.probe import Capture, Plan, Probe
from agent.shipper import Health, LambdaPoller, Sender
from agent.spool import Spool
from agent.transport import HttpTransport, TransportError
from monitor.scheduling import ScheduleConfig
from monitor.wire import STATUS_REASON_MAX, encode_value

logger = logging.getLogger(__name__)

INITIAL_FETCH_SECONDS = 2.0
"""How long attach() may spend getting the run's lambdas before the first step (collector up)."""
END_STATUSES = ("finished", "crashed")
"""What ``close(status=...)`` may say about how the run ended (None: say nothing)."""


@dataclass
class _Pending:
    """A report whose values are on their way to the host."""

    step: int
    time: float
    keys: list[tuple]
    values: Tensor
    floats: dict[str, float]
    events: list[dict[str, Any]]
    ready: Any = None  # a CUDA event, or None when values are already on the host
    lambda_layers: dict[str, list[float]] = field(default_factory=dict)


class _Offline:
    """The transport of an agent without a collector URL: every call fails retryably."""

    def _down(self, *args: Any) -> dict[str, Any]:
        raise TransportError("no collector URL configured (QKWATCH_URL)", retryable=True)

    create_run = post_reports = get_lambdas = _down

    def close(self) -> None:
        pass


class Agent:
    """Measures, spools and ships; reads lambdas back. Build it with :func:`attach`."""

    def __init__(self, model: nn.Module, cfg: AgentConfig, sites: list[Site]):
        self.cfg = cfg
        self.sites = sites
        self.n_layers = len(sites)
        shared = _distributed() if cfg.distributed is None else cfg.distributed and _distributed()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.run, attempt_key = self._agree_on_identity(cfg.run)
        self.attempt_key = attempt_key
        self.owned = {s.layer for s in sites if s.layer % self.world == self.rank}
        self.config = {**cfg.config, "n_layers": self.n_layers}
        self.schedule = ScheduleConfig.from_mapping(self.config.get("schedule"))
        self.health = Health()
        self.spool = Spool(
            Path(cfg.spool) / cfg.project / self.run / f"rank-{self.rank}",
            segment_bytes=cfg.segment_bytes,
            max_bytes=cfg.spool_max_bytes,
            max_age=cfg.spool_max_age_seconds,
        )
        meta = self.spool.read_meta()
        self.spool.write_meta(
            {
                **meta,
                "spool_id": meta.get("spool_id", str(uuid.uuid4())),
                "url": cfg.url,
                "project": cfg.project,
                "name": self.run,
                "config": self.config,
                "attempt_key": attempt_key,
                "rank": self.rank,
            }
        )
        self.lambdas_state = Lambdas(
            self.n_layers,
            self.schedule,
            sync_every=cfg.lambda_sync_every,
            stale_seconds=cfg.lambda_stale_seconds,
            group=self._group,
        )
        self.probe = Probe(
            sites,
            self.owned,
            sample_rows=cfg.sample_rows,
            sample_seqs=cfg.sample_seqs,
            heads=cfg.heads,
            pr_rows=cfg.pr_rows,
            spectrum_window=cfg.spectrum_window,
        )
        factory = self._transport_factory()
        self.sender = Sender(
            self.spool,
            factory,
            batch_max=cfg.batch_max_reports,
            flush_seconds=cfg.flush_seconds,
            backoff_base=cfg.backoff_base,
            backoff_cap=cfg.backoff_cap,
            health=self.health,
            name=f"qkwatch-sender-{self.rank}",
        )
        self.poller = (
            LambdaPoller(self.sender, factory, self.lambdas_state.offer, cfg.lambda_poll_seconds)
            if self.rank == 0 and cfg.url
            else None
        )
        self._pid = os.getpid()
        self._closed = False
        self._step = 0
        self._plan: Plan | None = None
        self._plan_time = 0.0
        self._first_report = True
        self._scalars: dict[str, tuple[int, float | Tensor]] = {}
        self._layer_values: dict[str, tuple[int, Any]] = {}
        self._applied: dict[int, list[float]] = {}
        self._overhead = 0.0
        self._overhead_steps = 0
        self._dropped_reported = self.spool.dropped
        self._spooler: _Spooler | None = None
        self._inert = False
        if self.rank == 0 and cfg.url:
            self._fetch_initial_lambdas()
        self.sender.start()
        if self.poller is not None:
            self.poller.start()
        _track_for_fork(self)

    # --- the training loop's calls -----------------------------------------------------------

    def step(self, step: int) -> None:
        """Tell the agent the optimizer step about to run (before its forward)."""
        if self._skip():
            return
        start = time.perf_counter()
        if self._plan is not None:
            self._finish_report()
        plan = Plan(
            step,
            weights=_due(step, self.cfg.weight_every),
            spectra=_due(step, self.cfg.spectra_every),
            activations=_due(step, self.cfg.every),
        )
        self._step = step
        if plan.any:
            self._plan, self._plan_time = plan, time.time()
            self.probe.arm(plan)
        self._overhead += time.perf_counter() - start
        self._overhead_steps += 1

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
        self._overhead += time.perf_counter() - start
        return list(values)

    def log(self, step: int, **scalars: float | Tensor) -> None:
        """Run-level values (loss, lr, eval results); shipped with the report of their step."""
        if self._skip() or self.rank != 0:
            return
        for name, value in scalars.items():
            self._scalars[name] = (step, value.detach() if isinstance(value, Tensor) else value)

    def log_layers(self, step: int, values: dict[str, Any]) -> None:
        """Per-layer values (e.g. ``{"lambda": [...], "par": tensor}``) for the report of ``step``."""
        if self._skip() or self.rank != 0:
            return
        for name, value in values.items():
            self._layer_values[name] = (step, value.detach() if isinstance(value, Tensor) else value)

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
            if self._plan is not None or self._unsent_scalars() or self.lambdas_state.has_events():
                self._finish_report()
        finally:
            self.probe.close()
            self._spool_status(status, reason)
            if self._spooler is not None:
                self._spooler.close(max(0.0, deadline - time.monotonic()))
            if self.poller is not None:
                self.poller.close(0.1)
            # offline (no URL) nothing can be delivered: do not spend the timeout trying
            finished = self.sender.close(max(0.0, deadline - time.monotonic()) if self.cfg.url else 0.0)
            if finished:
                self.spool.close()
            left = self.spool.bytes_pending() if finished else None
            if left:
                logger.warning(
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

    def _spool_status(self, status: str | None, reason: str | None) -> None:
        """Spool how the run ended as the record after the last report (in order through the GPU spooler)."""
        if status is None or (status == "finished" and self.rank != 0):
            return
        end: dict[str, Any] = {"status": status}
        if reason and reason.strip():
            end["reason"] = _bounded(reason.strip())
        record = {"attempt_key": self.attempt_key, "status": end}
        if self._spooler is not None:
            self._spooler.put(record)
        else:
            self._append_status(record)

    def _append_status(self, record: dict[str, Any]) -> None:
        try:
            self.spool.append(record)
        except (OSError, ValueError) as exc:
            logger.warning("qkwatch: could not spool the run's status %s: %s", record["status"], exc)
            return
        self.sender.notify()

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

    # --- reports ------------------------------------------------------------------------------

    def _finish_report(self) -> None:
        plan = self._plan or Plan(self._step)
        self.probe.measure_weights_now(plan)
        capture = self.probe.disarm()
        self._plan = None
        keys, tensors = [], []
        floats: dict[str, float] = {}
        for layer, metrics in capture.layers.items():
            for name, value in metrics.items():
                keys.append(("layer", name, layer))
                tensors.append(value.reshape(1))
        for layer, metrics in capture.heads.items():
            for name, value in metrics.items():
                keys.append(("heads", name, layer, value.numel()))
                tensors.append(value.reshape(-1))
        for name, (step, value) in list(self._scalars.items()):
            if step != plan.step and not self._closed:
                continue
            del self._scalars[name]
            if isinstance(value, Tensor):
                keys.append(("scalar", name))
                tensors.append(value.reshape(1))
            else:
                floats[name] = float(value)
        layer_values = self._layer_values_for(plan.step, keys, tensors)
        values = _stack(tensors)
        ready = None
        if values.device.type == "cuda":
            values = values.to("cpu", non_blocking=True)  # the report's one device-to-host copy
            ready = torch.cuda.Event()
            ready.record()
        floats.update(self._health_scalars())
        pending = _Pending(
            plan.step,
            self._plan_time or time.time(),
            keys,
            values,
            floats,
            self._events(plan, capture),
            ready,
            layer_values,
        )
        if ready is None:
            self._write(pending)
        else:
            if self._spooler is None:
                self._spooler = _Spooler(self)
            self._spooler.put(pending)

    def _layer_values_for(self, step: int, keys: list[tuple], tensors: list[Tensor]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, (logged_step, value) in list(self._layer_values.items()):
            if logged_step != step and not self._closed:
                continue
            del self._layer_values[name]
            if isinstance(value, Tensor):
                keys.append(("layers", name, value.numel()))
                tensors.append(value.reshape(-1))
            else:
                out[name] = [float(v) for v in value]
        if (
            "lambda" not in out
            and not any(k[:2] == ("layers", "lambda") for k in keys)
            and step in self._applied
            and self.rank == 0
        ):
            out["lambda"] = list(self._applied[step])
        return out

    def _write(self, pending: _Pending) -> None:
        """Host side: decode the stacked values, spool the report, feed the local schedule.

        Room is made in the spool before the report's own count of dropped reports is set, so the
        count it carries includes every drop made to fit it.
        """
        report = self._encode(pending)
        self.spool.make_room(len(json.dumps(report)) + 256)
        self._note_drops(report)
        self.spool.append({"attempt_key": self.attempt_key, "report": report})
        self.health.written += 1
        self.sender.notify()
        entropy = report["layers"].get("attn_entropy")
        if entropy:
            self.lambdas_state.observe(
                {i: float(v) for i, v in enumerate(entropy) if isinstance(v, float) and i in self.owned}
            )

    def _encode(self, pending: _Pending) -> dict[str, Any]:
        host = pending.values.tolist()  # values are on the host here: no synchronisation
        n = self.n_layers
        layers: dict[str, list[Any]] = {}
        heads: dict[str, list[Any]] = {}
        scalars: dict[str, Any] = {}
        pos = 0
        for key in pending.keys:
            if key[0] == "layer":
                layers.setdefault(key[1], [None] * n)[key[2]] = encode_value(host[pos])
                pos += 1
            elif key[0] == "heads":
                heads.setdefault(key[1], [None] * n)[key[2]] = [encode_value(v) for v in host[pos : pos + key[3]]]
                pos += key[3]
            elif key[0] == "layers":
                layers[key[1]] = [encode_value(v) for v in host[pos : pos + key[2]]]
                pos += key[2]
            else:
                scalars[key[1]] = encode_value(host[pos])
                pos += 1
        for name, values in pending.lambda_layers.items():
            layers[name] = [encode_value(v) for v in values]
        scalars.update({k: encode_value(v) for k, v in pending.floats.items()})
        report: dict[str, Any] = {"step": pending.step, "time": pending.time, "layers": layers, "scalars": scalars}
        if heads:
            report["heads"] = heads
        if pending.events:
            report["events"] = pending.events
        return report

    def _health_scalars(self) -> dict[str, float]:
        suffix = f"_rank{self.rank}" if self.world > 1 else ""
        h = self.health
        overhead = self._overhead / max(1, self._overhead_steps)
        self._overhead, self._overhead_steps = 0.0, 0
        values = {
            "agent_queue_depth": h.queue_depth,
            "agent_spool_bytes": self.spool.bytes_pending(),
            "agent_sent_total": h.sent,
            "agent_retried_total": h.retried,
            "agent_dead_lettered_total": h.dead_lettered,
            "agent_step_overhead_seconds": overhead,
        }
        out = {f"{k}{suffix}": float(v) for k, v in values.items()}
        if self.rank == 0:
            out["lambda_source"] = 0.0 if self.lambdas_state.source == "collector" else 1.0
            out["lambda_version"] = float(self.lambdas_state.version)
        return out

    def _note_drops(self, report: dict[str, Any]) -> None:
        suffix = f"_rank{self.rank}" if self.world > 1 else ""
        report["scalars"][f"agent_dropped_total{suffix}"] = float(self.spool.dropped)
        if self.spool.dropped > self._dropped_reported:
            count = self.spool.dropped - self._dropped_reported
            self._dropped_reported = self.spool.dropped
            report.setdefault("events", []).append(
                {
                    "kind": f"dropped{suffix}",
                    "message": f"{count} report(s) dropped by the spool's caps",
                    "data": {"count": count},
                }
            )

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
                message = (
                    f"layers {missing} produced no values on rank {self.rank} at step {plan.step}: their "
                    "forward did not run through the hooked modules (a fused fast path?)"
                )
                logger.warning("qkwatch: %s", message)
                events.append(
                    {
                        "kind": "missing_layers" if self.world == 1 else f"missing_layers_rank{self.rank}",
                        "message": message,
                        "data": {"layers": missing, "modules": names},
                    }
                )
        return events

    def _unsent_scalars(self) -> bool:
        return bool(self._scalars or self._layer_values)

    # --- setup --------------------------------------------------------------------------------

    def _agree_on_identity(self, run: str | None) -> tuple[str, str]:
        """Run name and attempt key, decided by rank 0 and shared (one collective, at attach)."""
        mine = [run or time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], uuid.uuid4().hex]
        if self._group is not None:
            dist.broadcast_object_list(mine, src=0, group=self._group)
        return mine[0], mine[1]

    def _transport_factory(self):
        cfg = self.cfg
        if not cfg.url:
            return _Offline
        return lambda: HttpTransport(cfg.url, cfg.token, cfg.request_timeout)

    def _fetch_initial_lambdas(self) -> None:
        """Before the first step: create the run and read its lambdas if the collector answers fast."""
        transport = HttpTransport(self.cfg.url, self.cfg.token, INITIAL_FETCH_SECONDS)
        try:
            answer = transport.create_run(
                {"project": self.cfg.project, "name": self.run, "config": self.config, "attempt_key": self.attempt_key}
            )
            self.sender.run_id = answer["id"]
            self.lambdas_state.offer(transport.get_lambdas(answer["id"]))
        except (TransportError, KeyError) as exc:
            logger.info("qkwatch: collector not reachable at start (%s); working offline until it is", exc)
        finally:
            transport.close()

    def _skip(self) -> bool:
        if self._inert or self._closed:
            return True
        if os.getpid() != self._pid:  # a forked DataLoader worker: leave the parent's agent alone
            self._inert = True
            return True
        return False


class _Spooler:
    """GPU only: waits for each report's host copy off the training thread, then spools it."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.queue: queue.Queue[_Pending | dict[str, Any] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="qkwatch-spooler", daemon=True)
        self.thread.start()

    def put(self, item: _Pending | dict[str, Any]) -> None:
        """A report on its way to the host, or the run's status record (spooled after what precedes it)."""
        self.queue.put(item)

    def close(self, timeout: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (pending := self.queue.get()) is not None:
            if isinstance(pending, dict):
                self.agent._append_status(pending)
                continue
            try:
                pending.ready.synchronize()
                self.agent._write(pending)
            except Exception:
                logger.exception("qkwatch: could not spool the report of step %d", pending.step)


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
    mapping: Mapping | None = None,
    **settings: Any,
) -> Agent:
    """Attach the agent to ``model`` (any supported transformer, FSDP2-sharded or not).

    Settings resolve as: the argument, then the environment (``QKWATCH_URL``, ``QKWATCH_TOKEN``,
    ``QKWATCH_PROJECT``, ``QKWATCH_RUN``, ``QKWATCH_SPOOL``, ``QKWATCH_EVERY``), then the default
    (see :class:`agent.config.AgentConfig` for every setting). With FSDP2, call it on every rank
    after ``fully_shard``; each rank measures ``layer % world == rank``.

    Raises:
        ValueError: a bad setting (named). agent.adapters.AdapterError: no attention found.
    """
    cfg = AgentConfig.resolve(
        url=url, token=token, project=project, run=run, spool=spool, every=every, config=config, **settings
    )
    sites = find_sites(model, mapping)
    return Agent(model, cfg, sites)


# --- helpers ------------------------------------------------------------------------------------


def exception_reason(exc: BaseException) -> str:
    """``"RuntimeError: <message>"`` (first line), the status reason of a run that raised."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


def _bounded(reason: str) -> str:
    return reason if len(reason) <= STATUS_REASON_MAX else reason[: STATUS_REASON_MAX - 3] + "..."


def _due(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _stack(tensors: list[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros(0)
    device = tensors[0].device
    return torch.cat([t.detach().to(device=device, dtype=torch.float32) for t in tensors])


_AGENTS: weakref.WeakSet[Agent] = weakref.WeakSet()
_FORK_HOOK: list[bool] = []


def _track_for_fork(agent: Agent) -> None:
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _FORK_HOOK.append(True)
    _AGENTS.add(agent)


def _after_fork_in_child() -> None:
    for agent in list(_AGENTS):
        agent._inert = True  # threads do not survive a fork; the child must not touch the spool
