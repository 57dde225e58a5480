"""Benchmark: what the agent costs a training step, A/B interleaved in one process.

    .venv/bin/python -m bench.agent_overhead [--steps 400] [--every 50] [--device cpu|cuda]

Two identical small GPTs (same init, same batches) train side by side, one step each in turn;
one has the agent attached at the default cadence, the other none. Measured in the same run:

* mean step time with and without the agent (the difference is the overhead), and the same with
  the collector down (a refused port: reports pile up in the spool) and with a live collector
  (``qkwatch serve`` on loopback);
* report-step latency: the step whose forward measures plus the next step, which ships;
* peak memory: the agent's allocations on a report step (CUDA: max_memory_allocated;
  CPU: tracemalloc of Python-side allocations and the peak RSS of the whole process).

Prints Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from qkwatch import agent
from qkwatch.launch import CollectorProcess, free_port
from qkwatch.nanogpt import NanoGPT

ROOT = Path(__file__).resolve().parents[1]


def make(device):
    torch.manual_seed(0)
    model = NanoGPT(vocab=512, d_model=128, n_head=4, n_layer=6, block=256).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def step_fn(model, opt, x, monitor, step, sync):
    start = time.perf_counter()
    if monitor is not None:
        monitor.step(step)
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 512), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.log(step, loss=loss.detach())
    sync()
    return time.perf_counter() - start


def ab(label, url, args, device, sync):
    """Interleave a model with the agent and one without; returns the row and per-step times."""
    a_model, a_opt = make(device)
    b_model, b_opt = make(device)
    spool = tempfile.mkdtemp()
    monitor = agent.attach(
        a_model,
        url=url,
        project="bench",
        run=f"overhead-{label.split()[0]}-{time.time_ns()}",
        spool=spool,
        every=args.every,
    )
    gen = torch.Generator().manual_seed(1)
    with_agent, without = [], []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 512, (args.batch, args.seq + 1), generator=gen).to(device)
        ta = step_fn(a_model, a_opt, x, monitor, step, sync)
        tb = step_fn(b_model, b_opt, x, None, step, sync)
        if step >= args.warmup:
            with_agent.append(ta)
            without.append(tb)
    start = time.perf_counter()
    monitor.close(timeout=5 if url else 0.5)
    close_s = time.perf_counter() - start
    mean_a, mean_b = statistics.fmean(with_agent), statistics.fmean(without)
    diffs = [a - b for a, b in zip(with_agent, without, strict=True)]  # paired by round: shared noise cancels
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    report_steps = [t for i, t in enumerate(with_agent) if (i + args.warmup) % args.every in (0, 1)]
    plain_steps = [t for i, t in enumerate(with_agent) if (i + args.warmup) % args.every not in (0, 1)]
    return {
        "label": label,
        "with": mean_a,
        "without": mean_b,
        "overhead": (mean_a - mean_b) / mean_b,
        "ci": 2 * se / mean_b,
        "report_pair": statistics.fmean(report_steps),
        "plain": statistics.median(plain_steps),
        "median_overhead": (statistics.median(with_agent) - statistics.median(without)) / statistics.median(without),
        "close": close_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    workdir = Path(tempfile.mkdtemp())
    with CollectorProcess(
        f"sqlite:///{workdir / 'collector.db'}", log=workdir / "collector.log", cwd=ROOT
    ) as collector:
        rows.append(ab("collector up", collector.url, args, device, sync))
    rows.append(ab("collector down", f"http://127.0.0.1:{free_port()}", args, device, sync))
    rows.append(ab("offline (no URL)", None, args, device, sync))
    print(
        f"\ndevice {device}, torch {torch.__version__}, threads {torch.get_num_threads()}; model: 6 layers, "
        f"d_model 128, 4 heads, batch {args.batch} x {args.seq} tokens; {args.steps} steps per arm, "
        f"report every {args.every}\n"
    )
    print(
        "| agent | step with (ms) | step without (ms) | mean overhead (± 2 SE, paired) | median overhead "
        "| report step + next (ms) | close (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['label']} | {1e3 * r['with']:.2f} | {1e3 * r['without']:.2f} | {100 * r['overhead']:+.2f} % "
            f"± {100 * r['ci']:.2f} | {100 * r['median_overhead']:+.2f} % | {1e3 * r['report_pair']:.2f} "
            f"(plain {1e3 * r['plain']:.2f}) | {r['close']:.2f} |"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the benchmark process: {peak:.0f} MiB")
    if device.type == "cuda":
        print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
