"""Benchmark: the agent's weight pass against a competent per-head numpy SVD loop, side by side (issue 33).

    .venv/bin/python -m bench.weight_pass [--repeats 5] [--threads 2]

Shape: 24 layers x 16 heads, d_model 1024, d_head 64, float32 (random weights; the cost does not
depend on the values). In one run, on the same weights, alternating A and B:

* qkwatch: ``qkwatch.agent.metrics.subspace.geometry`` on all 384 heads in one batched call (QKAI,
  the stable rank of ``W_Q W_K^T`` and ``qk_cos``), what the agent runs on every weight report;
* the peer a competent engineer writes first: per head, numpy's thin SVD of ``W_Q`` and ``W_K``
  (1024 x 64 each), the singular values of ``U_Q^T U_K`` for QKAI, and those of the 64 x 64 core
  ``diag(s_Q) V_Q^T V_K diag(s_K)`` for the stable rank (no ``d_model x d_model`` product formed).

Both compute the same numbers; the script checks they agree to 1e-4 before it prints anything. It
also measures this machine's float32 matmul rate (2048 x 2048 x 2048, the same threads) and sets the
pass's floor beside it: the three Gram products per head, ``W_Q^T W_Q``, ``W_K^T W_K`` and
``W_Q^T W_K``, are ``3 x 2 x 1024 x 64^2`` flops, 9.66 GFLOP for 384 heads, and no route that reads
the weights does less than about two thirds of that (the two Grams are symmetric).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from qkwatch.agent.metrics.subspace import geometry

L, H, D, HS = 24, 16, 1024, 64
GOAL = 50.0
PAUSE = 1.0
GRAM_GFLOP = 3 * 2 * D * HS * HS * L * H / 1e9


def per_head_svd(wq: np.ndarray, wk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """QKAI and stable rank per head, ``(heads,)`` each, by numpy SVDs one head at a time."""
    qkai, srank = np.empty(len(wq)), np.empty(len(wq))
    for h, (q, k) in enumerate(zip(wq, wk, strict=True)):
        uq, sq, vqt = np.linalg.svd(q, full_matrices=False)
        uk, sk, vkt = np.linalg.svd(k, full_matrices=False)
        c = np.linalg.svd(uq.T @ uk, compute_uv=False)
        qkai[h] = np.mean(c**2)
        s = np.linalg.svd((sq[:, None] * vqt) @ (sk[:, None] * vkt).T, compute_uv=False)
        srank[h] = (s**2).sum() / s[0] ** 2
    return qkai, srank


def matmul_gflops(repeats: int) -> float:
    x = torch.randn(2048, 2048)
    x @ x
    best = min(_seconds(lambda: x @ x) for _ in range(repeats))
    return 2 * 2048**3 / best / 1e9


def _seconds(fn, pause: float = 0.0) -> float:
    time.sleep(pause)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_pass", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(0)
    wq = torch.randn(L, H, D, HS, generator=gen) / D**0.5
    wk = torch.randn(L, H, D, HS, generator=gen) / D**0.5
    q_np, k_np = wq.reshape(-1, D, HS).numpy(), wk.reshape(-1, D, HS).numpy()

    ours = geometry(wq, wk)
    qkai, srank = per_head_svd(q_np, k_np)
    for name, theirs in (("qkai", qkai), ("stable_rank", srank)):
        err = np.abs(ours[name].reshape(-1).double().numpy() - theirs) / np.maximum(1.0, np.abs(theirs))
        if err.max() > 1e-4:
            raise SystemExit(f"{name}: qkwatch and the per-head loop differ by {err.max():.2e} (> 1e-4)")

    a, b, grams = [], [], []
    q3, k3 = wq.reshape(-1, D, HS), wk.reshape(-1, D, HS)
    for _ in range(args.repeats):  # alternating, so a change in the machine's load falls on both
        # a pause before each (untimed): numpy's and torch's BLAS threads spin for a while after a
        # call, and without it each arm pays for the other's spinning threads
        a.append(_seconds(lambda: geometry(wq, wk), pause=PAUSE))
        b.append(_seconds(lambda: per_head_svd(q_np, k_np), pause=PAUSE))
        grams.append(_seconds(lambda: (q3.mT @ q3, k3.mT @ k3, q3.mT @ k3), pause=PAUSE))
    rate = matmul_gflops(args.repeats)
    ta, tb, tg = statistics.median(a), statistics.median(b), statistics.median(grams)
    print(f"\ntorch {torch.__version__}, {args.threads} threads; {L} x {H} heads, d_model {D}, d_head {HS}, float32\n")
    print(f"| what | ms (median of {args.repeats}) | |")
    print("|---|---:|---|")
    print(
        f"| qkwatch `geometry`, 384 heads in one call | {1e3 * ta:.1f} | {GRAM_GFLOP / ta:.0f} GFLOP/s of Gram work |"
    )
    print(
        f"| of which the three Gram products alone (batched matmuls) | {1e3 * tg:.1f} | {GRAM_GFLOP / tg:.0f} GFLOP/s |"
    )
    print(f"| per-head numpy SVD loop | {1e3 * tb:.1f} | |")
    floor = f"floor: {GRAM_GFLOP:.2f} GFLOP of Grams at this machine's matmul rate, {rate:.0f} GFLOP/s"
    print(f"| {floor} | {1e3 * GRAM_GFLOP / rate:.1f} | |")
    print(
        f"\nqkwatch is {tb / ta:.1f}x the per-head loop (goal >= {GOAL:g}x: {'met' if tb / ta >= GOAL else 'not met'});"
    )
    print(f"the Gram floor alone would allow {tb / (GRAM_GFLOP / rate):.0f}x, the Grams as measured {tb / tg:.0f}x;")
    print(f"the rest of the pass (per-head Cholesky, triangular solves, eigvalsh) takes {1e3 * (ta - tg):.1f} ms.")
    print(f"per-head loop, every repeat (ms): {' '.join(f'{1e3 * x:.0f}' for x in b)}; values agree to 1e-4.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
