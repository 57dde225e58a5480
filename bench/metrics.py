"""Benchmark: the weight and activation metrics at seed 000's 1.3B shape, side by side.

    .venv/bin/python -m bench.metrics [--device cpu|cuda] [--naive-layers 1] [--no-weightwatcher]

Weights: 24 layers x 16 heads, d_model 2048, d_head 128, float32 (random; the cost does not
depend on the values). Compared in one run, on the same weights:

* qkwatch: ``agent.metrics.summary.weight_metrics`` on all layers in one batched call, with and
  without the projection spectra (norms and ``wk_erank``, one SVD per 2048 x 2048 projection);
* naive: a per-head numpy loop computing the same numbers from their textbook definitions (SVD of
  each head's factors, then of U_Q^T U_K; the d_model x d_model product M = Wq Wk^T formed and
  decomposed for its stable rank); timed on ``--naive-layers`` layers and scaled to 24;
* per-head numpy, same algorithm as qkwatch (Cholesky QR per head): separates the gain of the
  algorithm from that of batching;
* WeightWatcher ``analyze()`` on a model holding the same query/key projections.

Activation statistics: 64 sampled queries x 2048 keys x 16 heads x 24 layers, plus the Q/K
participation ratios of the 64 sampled positions (as the agent measures them). Prints a Markdown
table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from qkwatch.agent.metrics import attention_stats, participation_ratio
from qkwatch.agent.metrics.summary import weight_metrics

L, H, D, HS = 24, 16, 2048, 128


def timed(fn, repeats: int, sync=lambda: None) -> list[float]:
    fn()  # warm-up (allocations, kernels)
    sync()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def naive_layer(wq: np.ndarray, wk: np.ndarray) -> dict[str, float]:
    """Textbook definitions, one head at a time, float32 numpy."""
    qk, sr = [], []
    for h in range(wq.shape[0]):
        uq = np.linalg.svd(wq[h], full_matrices=False)[0]
        uk = np.linalg.svd(wk[h], full_matrices=False)[0]
        c = np.linalg.svd(uq.T @ uk, compute_uv=False)
        qk.append(np.mean(c**2))
        s = np.linalg.svd(wq[h] @ wk[h].T, compute_uv=False)  # d_model x d_model
        sr.append((s**2).sum() / s[0] ** 2)
    full_q = wq.transpose(1, 0, 2).reshape(D, -1)
    full_k = wk.transpose(1, 0, 2).reshape(D, -1)
    cos = np.abs((full_q * full_k).sum(0) / np.linalg.norm(full_q, axis=0) / np.linalg.norm(full_k, axis=0))
    return {"qkai": float(np.mean(qk)), "stable_rank": float(np.mean(sr)), "qk_cos": float(cos.mean())}


def per_head_same_algorithm(wq: np.ndarray, wk: np.ndarray) -> None:
    """qkwatch's algorithm (Cholesky QR, d_head x d_head core), in a per-head numpy loop."""
    for h in range(wq.shape[0]):
        lq = np.linalg.cholesky(wq[h].T @ wq[h])
        lk = np.linalg.cholesky(wk[h].T @ wk[h])
        c = np.linalg.solve(lq, wq[h].T @ wk[h])
        c = np.linalg.solve(lk, c.T)
        _ = (c**2).sum()
        core = lq.T @ lk
        _ = (core**2).sum() / np.linalg.eigvalsh(core.T @ core)[-1]


def weightwatcher_seconds(wq: torch.Tensor, wk: torch.Tensor) -> float | None:
    try:
        import weightwatcher as ww
    except ImportError:
        return None
    layers = torch.nn.ModuleList()
    for i in range(L):
        q, k = torch.nn.Linear(D, H * HS, bias=False), torch.nn.Linear(D, H * HS, bias=False)
        q.weight.data = wq[i].transpose(0, 1).reshape(D, -1).T.contiguous()  # back to (out, in)
        k.weight.data = wk[i].transpose(0, 1).reshape(D, -1).T.contiguous()
        layers.append(torch.nn.ModuleDict({"q": q, "k": k}))
    watcher = ww.WeightWatcher(model=layers)
    start = time.perf_counter()
    watcher.analyze()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.metrics", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-layers", type=int, default=1)
    parser.add_argument("--no-weightwatcher", action="store_true")
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    wq = (torch.randn(L, H, D, HS, generator=gen) / D**0.5).to(dev)
    wk = (torch.randn(L, H, D, HS, generator=gen) / D**0.5).to(dev)
    torch.set_grad_enabled(False)

    rows = []
    core = timed(lambda: weight_metrics(wq, wk, spectra=False), args.repeats, sync)
    full = timed(lambda: weight_metrics(wq, wk, spectra=True), args.repeats, sync)
    rows.append(("qkwatch weight metrics (qkai, qkai_max, stable_rank, qk_cos), 24 layers", statistics.median(core)))
    rows.append(("qkwatch weight metrics + projection spectra (norms, wk_erank)", statistics.median(full)))

    q_np, k_np = wq.cpu().numpy(), wk.cpu().numpy()
    n = args.naive_layers
    start = time.perf_counter()
    naive = [naive_layer(q_np[i], k_np[i]) for i in range(n)]
    naive_s = (time.perf_counter() - start) * L / n
    rows.append((f"naive per-head numpy loop, textbook definitions (measured on {n} layer(s), x{L // n})", naive_s))
    start = time.perf_counter()
    for i in range(L):
        per_head_same_algorithm(q_np[i], k_np[i])
    rows.append(("per-head numpy loop, qkwatch's algorithm", time.perf_counter() - start))
    ww_s = None if args.no_weightwatcher or dev.type != "cpu" else weightwatcher_seconds(wq.cpu(), wk.cpu())
    if ww_s is not None:
        rows.append(("WeightWatcher analyze() on the same 48 projections", ww_s))

    ours = weight_metrics(wq[:n], wk[:n], spectra=False)[0]
    for name in ("qkai", "stable_rank", "qk_cos"):  # the naive loop computes the same numbers
        assert abs(ours[name][0].item() - naive[0][name]) < 1e-4 * max(1.0, abs(naive[0][name])), name

    q = torch.randn(L, H, 64, HS, generator=gen).to(dev)
    k = torch.randn(L, H, 2048, HS, generator=gen).to(dev)

    rows_at = torch.linspace(1, 2047, 64).long().to(dev)

    def activations() -> None:
        attention_stats(q, k, q_pos=rows_at)
        participation_ratio(q.transpose(1, 2).flatten(-2))  # (L, 64, H*hs)
        participation_ratio(k[:, :, rows_at].transpose(1, 2).flatten(-2))  # keys at the same 64 positions

    act = timed(activations, args.repeats, sync)
    rows.append(
        ("activation stats: 64 queries x 2048 keys x 16 heads x 24 layers, + PR_q/PR_k", statistics.median(act))
    )

    print(f"\ndevice: {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}\n")
    print("| what | seconds | qkwatch core is faster by |")
    print("|---|---:|---:|")
    base = statistics.median(core)
    for name, secs in rows:
        ratio = f"{secs / base:.1f}x" if "qkwatch" not in name and "activation" not in name else ""
        print(f"| {name} | {secs:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
