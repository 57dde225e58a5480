"""Benchmark: what the agent costs a training step, in interleaved A/B rounds with a bootstrap interval.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.agent_overhead [--rounds 30] [--every 50]
        [--collector up|down|offline] [--ranks 1|2] [--layers 6 --d-model 128 --heads 4 --batch 8 --seq 128]
        [--profile] [--device cpu|cuda] [--sinks tensorboard[,wandb,mlflow]]

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

``--sinks tensorboard`` (or ``wandb``, ``mlflow``, comma-separated; one rank): the sinks' cost to the
step. Both arms have the agent, attached the same way; arm A's also sends every report to the sinks
(``bench.agent_overhead.sinks``: TensorBoard event files, W&B offline, MLflow on a file store, all in
a temporary folder). The same rounds and statistics; also each arm's training thread inside its
agent, and the sinks' worker thread's wall clock and CPU time a round (off the training thread).
``--sinks none``: both arms with the agent and no sink, the A/A control.

``--profile``: after the timed rounds, cProfile of arm A's report step and the step after it
(three pairs), the agent's own functions by cumulative time.

Prints Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from bench.agent_overhead import sinks
from bench.agent_overhead.arms import VOCAB, measure
from bench.agent_overhead.parts import parts
from bench.agent_overhead.summary import summarize
from qkwatch.launch import CollectorProcess, free_port

ROOT = Path(__file__).resolve().parents[2]


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
        "--sinks",
        type=sinks.parse,
        default=(),
        help=f"A/B of the sinks: both arms with the agent, arm A's with these sinks too ({', '.join(sinks.NAMES)}; "
        f"{sinks.CONTROL}: no sink in either arm, the A/A control)",
    )
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
    if args.sinks and args.ranks > 1:
        parser.error("--sinks runs on one rank")
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
        f"wall {wall / 60:.1f} min; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}"
        + (f"; {sinks.arms(args.sinks)}" if args.sinks else "")
        + "\n"
    )
    with_, without, whose = ("with", "without", "the")
    if args.sinks:
        control = args.sinks == (sinks.CONTROL,)
        with_, without, whose = (
            ("of arm A", "of arm B", "arm A's") if control else ("with the sinks", "without", "arm A's")
        )
    print(
        f"| step {with_} (ms) | step {without} (ms) | mean overhead | median | 95 % bootstrap CI of the mean "
        "| report step + next, extra (ms) | plain step, extra (ms) | close (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {1e3 * s['a_step']:.2f} | {1e3 * s['b_step']:.2f} | {100 * s['mean']:+.2f} % | {100 * s['median']:+.2f} % "
        f"| [{100 * s['low']:+.2f} %, {100 * s['high']:+.2f} %] | {s['report_pair']:.1f} "
        f"({s['report_step']:.1f} + {s['next_step']:.1f}) | {s['plain_steps']:+.3f} | {s['close']:.2f} |"
    )
    print(
        f"\ntraining thread inside {whose} agent (step, log, hooks): {s['inside_ms']:.1f} ms a round, "
        f"{100 * s['share']:.3f} % of the round without it, 95 % bootstrap CI "
        f"[{100 * s['share_low']:.3f} %, {100 * s['share_high']:.3f} %]; the measure thread's own work: "
        f"{s['worker_ms']:.1f} ms a round (a spare core's, or taken from the step where there is none)"
    )
    if args.sinks:
        sinks.print_summary(s, per_rank[0]["sinks"], args.sink_dir)
    else:
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
