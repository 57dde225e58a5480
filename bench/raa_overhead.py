"""Step time of RAA with scheduling, RAA on every layer every step, and vanilla, interleaved on the CPU.

    .venv/bin/python bench/raa_overhead.py [--rounds 6] [--steps 3] [--threads 1] [--json out.json]

One process builds three 24-layer GPTs from the same seed and trains them in turn, a few full
optimizer steps each per round (forward, loss, backward, clipping, AdamW: ``trainer.train.train_step``),
the order shuffled every round, so that a busy machine slows all three alike:

* ``vanilla``: RAA off (no rotation, no penalty, no lambdas read).
* ``scheduled``: RAA on, the Householder rotation on every layer, PAR on the 7 of 24 layers whose
  lambda is above the floor (layers 9-15, the band seed 000 reports: "the full penalty on only
  about 7 of 24 layers for most of training"); the lambdas come through the monitor seam.
* ``every_layer``: RAA on, PAR on all 24 layers every step (``raa.schedule=false``).
* ``scheduled_every4``: as ``scheduled`` with ``raa.every=4``: PAR on the flagged layers every 4th
  step, weighted by 4 (seed 000's mitigation: "computed every k steps rather than every step").

Reports the median step time of each and its overhead over vanilla, paired by round, in thread
CPU time (robust on a shared machine) and in wall time (goal: scheduled <= 2 %; seed 000 reports
3 % scheduled and 9 % unscheduled at 1.3B on GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer import recipes
from trainer.config import TrainConfig
from trainer.model import ModelConfig
from trainer.parallelize import init_distributed
from trainer.train import apply_lambdas, setup, train_step

N_LAYERS = 24
BAND = range(9, 16)  # 7 of 24 layers


class BandLambdas:
    """The monitor seam giving lambda_0 on the band and 0 elsewhere (what the collector's schedule sends)."""

    def __init__(self, lambda_0: float) -> None:
        self.value = [lambda_0 if i in BAND else 0.0 for i in range(N_LAYERS)]

    def step(self, step): pass
    def lambdas(self): return self.value
    def log(self, step, **scalars): pass
    def log_layers(self, step, values): pass
    def close(self, timeout=10.0): pass


def config(variant: str, d_model: int, seq_len: int, batch: int):
    cfg = recipes.debug_cpu()
    raa = dataclasses.replace(cfg.raa, enabled=variant != "vanilla", schedule=variant.startswith("scheduled"),
                              every=4 if variant == "scheduled_every4" else 1)
    return dataclasses.replace(
        cfg, recipe=f"bench-{variant}", raa=raa, init=dataclasses.replace(cfg.init, qk_regime="default"),
        model=ModelConfig(n_layers=N_LAYERS, n_heads=d_model // 64, d_model=d_model, max_seq_len=seq_len),
        data=dataclasses.replace(cfg.data, task_mix=0.0),
        train=TrainConfig(steps=10_000, global_batch_size=batch, log_every=10_000, report_every=10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="write the raw step times here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    variants = ["vanilla", "scheduled", "every_layer", "scheduled_every4"]
    runs, steps, times = {}, {}, {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            cfg = config(v, args.d_model, args.seq_len, args.batch)
            env = init_distributed(cfg.parallel)
            runs[v] = setup(cfg, env, Path(tmp) / v, False, BandLambdas(cfg.raa.lambda_0))
            steps[v] = 0

        def one_step(v: str) -> tuple[float, float]:
            r = runs[v]
            wall, cpu = time.perf_counter(), time.thread_time()
            train_step(r, steps[v], apply_lambdas(r, steps[v]))
            steps[v] += 1
            return time.perf_counter() - wall, time.thread_time() - cpu

        for v in variants:  # warm-up: first calls, allocator, AdamW state
            for _ in range(2):
                one_step(v)
        flagged = {v: sum(x > 0 for x in runs[v].raa.lambdas(runs[v].monitor)) for v in variants}
        rng = random.Random(0)
        for _ in range(args.rounds):
            order = variants[:]
            rng.shuffle(order)
            for v in order:
                times[v].append([one_step(v) for _ in range(args.steps)])
    print(f"model: {N_LAYERS} layers, d_model {args.d_model}, {args.d_model // 64} heads of 64, "
          f"{args.batch} x {args.seq_len} tokens per step, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps per variant, order shuffled per round")
    print(f"{'variant':<12}{'PAR layers':>11}{'cpu s/step':>12}{'cpu overhead':>24}{'wall s/step':>13}"
          f"{'wall overhead':>24}")
    for v in variants:
        cells = [f"{v:<12}{flagged[v]:>11}"]
        for col in (1, 0):  # thread CPU time, then wall time
            per_round = [statistics.mean(t[col] for t in rnd) for rnd in times[v]]
            base = [statistics.mean(t[col] for t in rnd) for rnd in times["vanilla"]]
            ratios = sorted((a / b - 1) * 100 for a, b in zip(per_round, base, strict=True))
            lo, hi = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            spread = f"{statistics.median(ratios):+.1f}% [{lo:+.1f}, {hi:+.1f}]"
            cells.append(f"{statistics.median(per_round):>{12 if col else 13}.3f}{spread:>24}")
        print("".join(cells))
    print("overhead: median over rounds of (variant / vanilla in the same round) - 1, [quartiles]; "
          "cpu = this thread's CPU time, which other processes on a busy machine barely move")
    if args.json:
        Path(args.json).write_text(json.dumps({"times": times, "flagged": flagged, "args": vars(args)}))

if __name__ == "__main__":
    main()
