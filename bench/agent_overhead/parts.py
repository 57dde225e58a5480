"""``--parts`` of the agent-overhead bench: what one report costs, piece by piece and metric family by
family, on the bench's model (one process, no A/B).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.agent_overhead.arms import VOCAB, make
from qkwatch import agent


def parts(args: argparse.Namespace) -> None:
    """``--parts``: what one report costs, piece by piece and metric family by family, on the bench's
    model (one process, no A/B), so that a user can pick each family's cadence."""
    from qkwatch.agent.metrics import attention_spectrum, attention_stats, participation_ratio, qk_erank
    from qkwatch.agent.metrics.spectra import projection_norms
    from qkwatch.agent.metrics.summary import _layer_matrix, weight_metrics
    from qkwatch.agent.probe.plan import Plan

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
