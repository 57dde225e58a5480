"""Benchmark: what the agent costs a training step, in interleaved A/B rounds with a bootstrap interval.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.agent_overhead [--rounds 30] [--every 50]
        [--collector up|down|offline] [--ranks 1|2] [--layers 6 --d-model 128 --heads 4 --batch 8 --seq 128]
        [--profile] [--device cpu|cuda]

Two identical GPTs (``qkwatch.nanogpt.NanoGPT``: same init, same batches) train side by side in one
process (per rank), one step each in turn; arm A has the agent attached at the default cadence
(``every``, a report of every layer's weight and activation metrics every 50 steps), arm B none.
A round is ``every`` steps of each arm, so it holds exactly one report step and the step after it
(which packs and spools the report); the arm that steps first alternates from round to round, so
neither arm always runs on warm caches. Per round the overhead is ``sum(A) / sum(B) - 1``; the
rounds' mean, median, and a 95 % percentile-bootstrap interval of the mean (10,000 resamples of
the rounds, seed 0) are printed. "Proven <= 0.5 %" means the interval's upper bound is under it.

``--ranks 2``: the same under FSDP2 on gloo, two processes (``torch.multiprocessing``, one thread
each); both models are ``fully_shard``-ed per block, each rank trains on its own batches and
measures its own layers (``layer % world == rank``); a round's time is the slower rank's.

``--profile``: after the timed rounds, cProfile of arm A's report step and the step after it
(three pairs), the agent's own functions by cumulative time.

Prints Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from qkwatch import agent
from qkwatch.launch import CollectorProcess, free_port
from qkwatch.nanogpt import NanoGPT

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
RESAMPLES = 10_000


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


def run_arms(args: argparse.Namespace, url: str | None, device: torch.device) -> dict[str, Any]:
    """This rank's interleaved rounds: per round, per arm, the ``every`` step times (seconds)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    a_model, a_opt = make(args, device)
    b_model, b_opt = make(args, device)
    monitor = agent.attach(
        a_model,
        url=url,
        project="bench",
        run=args.run_name,
        spool=args.spool,
        every=args.every,
        **({} if args.measure_thread is None else {"measure_thread": args.measure_thread}),
    )
    on_thread = OnThread()
    # the hooks call self._guarded: an instance attribute shadows the method; step and log likewise
    monitor.probe._guarded = on_thread.wrap(monitor.probe._guarded)  # type: ignore[method-assign]
    monitor.step = on_thread.wrap(monitor.step)  # type: ignore[method-assign]
    monitor.log = on_thread.wrap(monitor.log)  # type: ignore[method-assign]
    worker = OnThread()  # the measure thread's own work (not on the training thread)
    monitor.probe._activation_batch = worker.wrap(monitor.probe._activation_batch)  # type: ignore[method-assign]
    monitor.probe._weight_values = worker.wrap(monitor.probe._weight_values)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1 + rank)
    arms = {"A": (a_model, a_opt, monitor), "B": (b_model, b_opt, None)}
    times: list[dict[str, list[float]]] = []
    step = 0
    for round_ in range(args.warmup_rounds + args.rounds):
        order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
        got: dict[str, list[float]] = {"A": [], "B": [], "agent": [], "worker": []}
        on_thread.seconds = worker.seconds = 0.0
        for _ in range(args.every):  # step % every == 0 first: the report step, then the step that ships it
            x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=gen).to(device)
            for arm in order:
                model, opt, mon = arms[arm]
                got[arm].append(train_step(model, opt, x, mon, step, sync))
            step += 1
        if round_ >= args.warmup_rounds:
            got["agent"].append(on_thread.seconds)
            got["worker"] = [worker.seconds]
            times.append(got)
    profile = None
    if args.profile:
        profile = profile_reports(a_model, a_opt, monitor, args, device, gen, step, sync)
    start = time.perf_counter()
    monitor.close(timeout=5 if url else 0.5)
    close_s = time.perf_counter() - start
    params = sum(p.numel() for p in a_model.parameters())  # a DTensor's numel is its global one
    return {"times": times, "close": close_s, "profile": profile, "params": params}


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


def parts(args: argparse.Namespace) -> None:
    """``--parts``: what one report costs, piece by piece and metric family by family, on the bench's
    model (one process, no A/B), so that a user can pick each family's cadence."""
    from qkwatch.agent.metrics import attention_spectrum, attention_stats, participation_ratio, qk_erank
    from qkwatch.agent.metrics.spectra import projection_norms
    from qkwatch.agent.metrics.summary import _layer_matrix, weight_metrics
    from qkwatch.agent.probe import Plan

    model, _ = make(args, torch.device("cpu"))
    monitor = agent.attach(model, url=None, project="bench", run="parts", spool=tempfile.mkdtemp(), every=args.every)
    probe = monitor.probe
    x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    for site in probe.sites:
        site.install_tap(lambda q, k, mask=None, causal=None: caught.append((q.detach(), k.detach())))
    with torch.no_grad():
        model(x)
    pairs = list(zip(probe.sites, caught, strict=True))

    def timed(fn: Callable[[], object], n: int = 20) -> str:
        fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return f"{1e3 * min(times):.2f} | {1e3 * statistics.median(times):.2f}"

    def inline() -> None:
        for site, (q, k) in pairs:
            probe.sampler.metrics(site, probe.sampler.inputs(site, q, k, None, None, copy=False))

    def copies() -> list[tuple[Any, dict[str, torch.Tensor]]]:
        return [(site, probe.sampler.inputs(site, q, k, None, None, copy=True)) for site, (q, k) in pairs]

    queued = copies()
    site = pairs[0][0]
    rows = {n: torch.stack([inputs[n] for _, inputs in queued]) for n in queued[0][1] if n != "pos"}
    seqs_k, first_k = rows["seqs_k"], rows["seqs_k"].select(-4, 0)
    w = rows["spectrum_q"].shape[-2]
    weights = [s.weights() for s in probe.sites]
    wq, wk = torch.stack([w_[0] for w_ in weights]).detach(), torch.stack([w_[1] for w_ in weights]).detach()

    def weights_at_step() -> None:
        probe._weights_cache.clear()  # measure, as after an optimizer step
        probe.arm(Plan(0, weights=True))  # reads the weights (CPU: copies them for the measure thread)
        probe.disarm()

    n_heads = args.layers * args.heads
    print(f"\nload average {os.getloadavg()[0]:.2f}; one thread; best and median of 20\n")
    print("| piece of a report | best (ms) | median (ms) |\n|---|---:|---:|")
    for label, fn in [
        (f"activation metrics of {args.layers} layers, layer by layer in the hook (`measure_thread=False`)", inline),
        ("copies of the sampled rows, all layers (training thread, `measure_thread=True`)", copies),
        ("activation metrics of all layers in one batch (the measure thread)", lambda: probe._activation_batch(queued)),
        ("weight metrics of all layers, batched (read at `step()`, measured in the measure thread)", weights_at_step),
    ]:
        print(f"| {label} | {timed(fn)} |")
    print("\n| metric family (all layers in one call) | what it reports | best (ms) | median (ms) |")
    print("|---|---|---:|---:|")
    families: list[tuple[str, str, Callable[[], object]]] = [
        (
            "row statistics",
            "attn_entropy(_nats), attn_top1/top5/gap, logit_mean/std/max",
            lambda: attention_stats(rows["stats_q"], seqs_k, causal=True, q_pos=queued[0][1]["pos"], erank=False),
        ),
        ("`qk_erank`", "effective rank of Q K^T of the sampled rows", lambda: qk_erank(rows["erank_q"], first_k)),
        (
            f"attention spectrum ({n_heads} heads, {w} x {w})",
            "attn_srank, attn_gap1",
            lambda: attention_spectrum(rows["spectrum_q"], first_k[..., :w, :], causal=site.causal),
        ),
        (
            "participation ratios",
            "pr_q, pr_k, pr_gap",
            lambda: (participation_ratio(rows["pr_q"].float()), participation_ratio(rows["pr_k"].float())),
        ),
        (
            "weight geometry",
            "qkai, qkai_max, stable_rank, qk_cos",
            lambda: weight_metrics(wq, wk, None, spectra=False),
        ),
        (
            "projection spectra (every `spectra_every` steps)",
            "wq_fro, wk_fro, wq_spec, wk_spec, wk_erank",
            lambda: (projection_norms(_layer_matrix(wq)), projection_norms(_layer_matrix(wk))),
        ),
    ]
    with torch.no_grad():  # as the probe measures
        for name, what, fn in families:
            print(f"| {name} | {what} | {timed(fn)} |")

    def finish() -> None:
        for step in range(1, args.every):
            monitor.log(step, loss=torch.tensor(1.0))
        monitor.step(args.every)
        with torch.no_grad():
            model(x)
        time.sleep(0.3)  # the measure thread is done: what is left is the training thread's
        start = time.perf_counter()
        monitor._finish_report()
        spent.append(time.perf_counter() - start)

    spent: list[float] = []
    for _ in range(10):
        finish()
    print(
        f"\nfinishing a report at the next `step()` (training thread: collect, pack, encode, spool {args.every} "
        f"records): best {1e3 * min(spent):.2f} ms, median {1e3 * statistics.median(spent):.2f} ms"
    )
    monitor.close(timeout=0.1, status=None)


def bootstrap_mean(values: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean of ``values``."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[idx].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(per_rank: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Rounds' overheads (a round's time: the slowest rank's), their statistics and a per-position breakdown."""
    rounds = len(per_rank[0]["times"])
    a_sum = np.array([max(sum(r["times"][i]["A"]) for r in per_rank) for i in range(rounds)])
    b_sum = np.array([max(sum(r["times"][i]["B"]) for r in per_rank) for i in range(rounds)])
    rel = a_sum / b_sum - 1.0
    low, high = bootstrap_mean(rel)
    # the training thread's time inside the agent, as a share of the round without it (slowest rank)
    inside = np.array([max(r["times"][i]["agent"][0] for r in per_rank) for i in range(rounds)])
    share = inside / b_sum
    share_low, share_high = bootstrap_mean(share)
    worker = np.array([max(r["times"][i]["worker"][0] for r in per_rank) for i in range(rounds)])
    first = per_rank[0]["times"]  # rank 0's steps by position in the round

    def extra(pos: Callable[[int], bool]) -> float:
        """Median over rounds of A - B summed over the positions selected (ms)."""
        per_round = [sum(a - b for j, (a, b) in enumerate(zip(t["A"], t["B"], strict=True)) if pos(j)) for t in first]
        return 1e3 * statistics.median(per_round)

    return {
        "rounds": rounds,
        "a_step": float(a_sum.mean()) / every,
        "b_step": float(b_sum.mean()) / every,
        "mean": float(rel.mean()),
        "median": float(np.median(rel)),
        "low": low,
        "high": high,
        "rel": rel,
        "report_pair": extra(lambda j: j in (0, 1)),
        "report_step": extra(lambda j: j == 0),
        "next_step": extra(lambda j: j == 1),
        "plain_steps": extra(lambda j: j not in (0, 1)) / (every - 2),
        "close": max(r["close"] for r in per_rank),
        "params": per_rank[0]["params"],
        "inside_ms": 1e3 * float(inside.mean()),
        "worker_ms": 1e3 * float(worker.mean()),
        "share": float(share.mean()),
        "share_low": share_low,
        "share_high": share_high,
    }


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
    if args.ranks == 1:
        return [run_arms(args, url, device)]
    out = tempfile.mkdtemp()
    mp.spawn(rank_main, args=(args.ranks, free_port(), args, url, out), nprocs=args.ranks, join=True)
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(args.ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds of `every` steps per arm")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--every", type=int, default=50, help="the agent's report cadence (its default: 50)")
    parser.add_argument("--collector", choices=("up", "down", "offline"), default="up")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--parts", action="store_true", help="time the pieces of one report instead (no A/B)")
    parser.add_argument(
        "--measure-thread",
        choices=("on", "off"),
        help="the agent's measure_thread setting (default: the agent's default)",
    )
    args = parser.parse_args()
    args.measure_thread = None if args.measure_thread is None else args.measure_thread == "on"
    device = torch.device(args.device)
    if args.ranks > 1 and device.type != "cpu":
        parser.error("--ranks 2 runs FSDP2 on gloo: CPU only")
    if args.parts:
        parts(args)
        return
    started = time.time()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp())
    if args.collector == "up":
        with CollectorProcess(
            f"sqlite:///{workdir / 'collector.db'}", log=workdir / "collector.log", cwd=ROOT
        ) as collector:
            per_rank = measure(args, collector.url, device)
    else:
        url = f"http://127.0.0.1:{free_port()}" if args.collector == "down" else None
        per_rank = measure(args, url, device)
    s = summarize(per_rank, args.every)
    wall = time.time() - started
    print(
        f"\ndevice {device}, torch {torch.__version__}, threads {torch.get_num_threads()} per process, "
        f"ranks {args.ranks}{' (FSDP2, gloo)' if args.ranks > 1 else ''}; NanoGPT {args.layers} layers, "
        f"d_model {args.d_model}, {args.heads} heads, vocab {VOCAB}, {s['params'] / 1e6:.2f} M parameters; "
        f"batch {args.batch} x {args.seq} tokens per rank; collector {args.collector}; report every {args.every}; "
        f"measure_thread {'default' if args.measure_thread is None else args.measure_thread}; "
        f"{s['rounds']} rounds of {args.every} steps per arm after {args.warmup_rounds} warm-up; "
        f"wall {wall / 60:.1f} min; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| step with (ms) | step without (ms) | mean overhead | median | 95 % bootstrap CI of the mean "
        "| report step + next, extra (ms) | plain step, extra (ms) | close (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {1e3 * s['a_step']:.2f} | {1e3 * s['b_step']:.2f} | {100 * s['mean']:+.2f} % | {100 * s['median']:+.2f} % "
        f"| [{100 * s['low']:+.2f} %, {100 * s['high']:+.2f} %] | {s['report_pair']:.1f} "
        f"({s['report_step']:.1f} + {s['next_step']:.1f}) | {s['plain_steps']:+.3f} | {s['close']:.2f} |"
    )
    print(
        f"\ntraining thread inside the agent (step, log, hooks): {s['inside_ms']:.1f} ms a round, "
        f"{100 * s['share']:.3f} % of the round without it, 95 % bootstrap CI "
        f"[{100 * s['share_low']:.3f} %, {100 * s['share_high']:.3f} %]; the measure thread's own work: "
        f"{s['worker_ms']:.1f} ms a round (a spare core's, or taken from the step where there is none)"
    )
    verdict = "PROVEN <= 0.5 %" if s["high"] < 0.005 else "NOT proven <= 0.5 %"
    print(f"\n{verdict}: upper bound {100 * s['high']:+.2f} %")
    print("per-round overheads (%): " + " ".join(f"{100 * v:+.2f}" for v in s["rel"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the benchmark process: {peak:.0f} MiB")
    if device.type == "cuda":
        print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    for rank, result in enumerate(per_rank):
        if result["profile"]:
            print(f"\ncProfile of arm A's report step + next (3 pairs), rank {rank}:\n```\n{result['profile']}```")


if __name__ == "__main__":
    main()
