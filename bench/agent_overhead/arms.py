"""The agent-overhead bench's model (``qkwatch.nanogpt.NanoGPT``, FSDP2 when distributed) and its
interleaved A/B rounds: per round, per arm, the step times, and the time spent inside the agent
(with ``--sinks``, in each arm's agent, and the sinks' worker's time off the training thread).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from bench.agent_overhead.sinks import make_sinks, watch_worker, worker_counts
from qkwatch import agent
from qkwatch.launch import free_port
from qkwatch.nanogpt import NanoGPT

VOCAB = 512


def make(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = NanoGPT(vocab=VOCAB, d_model=args.d_model, n_head=args.heads, n_layer=args.layers, block=args.seq).to(
        device
    )
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


class OnThread:
    """Seconds arm A's training thread spends inside the agent: ``step()``, ``log()`` and the probe's
    hooks (each measurement, ``_guarded``, timed around). A floor of the overhead, measured without
    the A/B noise; it misses what the agent costs the step indirectly (caches, the GIL, threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    monitor: agent.Agent | None,
    step: int,
    sync: Callable[[], None],
) -> float:
    start = time.perf_counter()
    if monitor is not None:
        monitor.step(step)
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.log(step, loss=loss.detach())
    sync()
    return time.perf_counter() - start


def attach(
    args: argparse.Namespace, model: nn.Module, url: str | None, run: str, sinks: list[Any] | None = None
) -> tuple[agent.Agent, OnThread, OnThread]:
    """The agent on ``model`` as the bench attaches it, with its training thread's time inside it and its
    measure thread's own work timed."""
    monitor = agent.attach(
        model,
        url=url,
        project="bench",
        run=run,
        spool=args.spool,
        every=args.every,
        **({} if args.measure_thread is None else {"measure_thread": args.measure_thread}),
        **({} if sinks is None else {"sinks": sinks}),
    )
    on_thread = OnThread()
    # the hooks call self._guarded: an instance attribute shadows the method; step and log likewise
    monitor.probe._guarded = on_thread.wrap(monitor.probe._guarded)  # type: ignore[method-assign]
    monitor.step = on_thread.wrap(monitor.step)  # type: ignore[method-assign]
    monitor.log = on_thread.wrap(monitor.log)  # type: ignore[method-assign]
    worker = OnThread()  # the measure thread's own work (not on the training thread)
    monitor.probe._activation_batch = worker.wrap(monitor.probe._activation_batch)  # type: ignore[method-assign]
    monitor.probe._weight_values = worker.wrap(monitor.probe._weight_values)  # type: ignore[method-assign]
    return monitor, on_thread, worker


def run_arms(args: argparse.Namespace, url: str | None, device: torch.device) -> dict[str, Any]:
    """This rank's interleaved rounds: per round, per arm, the ``every`` step times (seconds).

    Without ``args.sinks`` arm A has the agent and arm B none; with it both arms have the agent and
    arm A's also has the sinks (``bench.agent_overhead.sinks``).
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    a_model, a_opt = make(args, device)
    b_model, b_opt = make(args, device)
    sinks = make_sinks(args.sinks, args.sink_dir) if args.sinks else None
    monitor, on_thread, worker = attach(args, a_model, url, args.run_name, sinks)
    b_monitor, b_on_thread = None, OnThread()
    if args.sinks:
        b_monitor, b_on_thread, _ = attach(args, b_model, url, args.run_name + "-b")
    clock = watch_worker(monitor)
    gen = torch.Generator().manual_seed(1 + rank)
    arms = {"A": (a_model, a_opt, monitor), "B": (b_model, b_opt, b_monitor)}
    times: list[dict[str, list[float]]] = []
    step = 0
    for round_ in range(args.warmup_rounds + args.rounds):
        order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
        got: dict[str, list[float]] = {"A": [], "B": [], "agent": [], "worker": []}
        on_thread.seconds = worker.seconds = b_on_thread.seconds = 0.0
        sinks_before = clock.reading()
        for _ in range(args.every):  # step % every == 0 first: the report step, then the step that ships it
            x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen).to(device)
            for arm in order:
                model, opt, mon = arms[arm]
                got[arm].append(train_step(model, opt, x, mon, step, sync))
            step += 1
        if round_ >= args.warmup_rounds:
            got["agent"].append(on_thread.seconds)
            got["worker"] = [worker.seconds]
            if args.sinks:
                got["agent_b"] = [b_on_thread.seconds]
                got["sinks"] = [now - before for now, before in zip(clock.reading(), sinks_before, strict=True)]
            times.append(got)
    profile = None
    if args.profile:
        profile = profile_reports(a_model, a_opt, monitor, args, device, gen, step, sync)
    start = time.perf_counter()
    monitor.close(timeout=5 if url or sinks else 0.5)
    close_s = time.perf_counter() - start
    if b_monitor is not None:
        b_monitor.close(timeout=5 if url else 0.5)
    params = sum(p.numel() for p in a_model.parameters())  # a DTensor's numel is its global one
    return {"times": times, "close": close_s, "profile": profile, "params": params, "sinks": worker_counts(monitor)}


def profile_reports(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    monitor: agent.Agent,
    args: argparse.Namespace,
    device: torch.device,
    gen: torch.Generator,
    step: int,
    sync: Callable[[], None],
) -> str:
    """cProfile of arm A's report steps and the steps after them (three pairs), the agent's functions."""
    prof = cProfile.Profile()
    pairs = 0
    while pairs < 3:
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen).to(device)
        hot = step % args.every in (0, 1)
        if hot:
            prof.enable()
        train_step(model, opt, x, monitor, step, sync)
        if hot:
            prof.disable()
            pairs += step % args.every == 1
        step += 1
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(r"qkwatch/agent|linalg|nn/modules/module", 30)
    return out.getvalue()


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, url: str | None, out: str) -> None:
    """One FSDP2 rank (``--ranks 2``): gloo, one thread, its result pickled to ``out``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_arms(args, url, torch.device("cpu"))
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, url: str | None, device: torch.device) -> list[dict[str, Any]]:
    args.run_name = f"overhead-{args.collector}-{time.time_ns()}"
    args.spool = tempfile.mkdtemp()
    args.sink_dir = Path(tempfile.mkdtemp())
    if args.ranks == 1:
        return [run_arms(args, url, device)]
    out = tempfile.mkdtemp()
    mp.spawn(rank_main, args=(args.ranks, free_port(), args, url, out), nprocs=args.ranks, join=True)
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]
