"""Benchmark: what checkpoint checksums cost a save and a load, side by side (issue 42).

    .venv/bin/python -m bench.checksums [--megabytes 1024] [--rounds 3]

One process writes a DCP checkpoint of ``--megabytes`` of float32 tensors (a model's weights and
Adam's two moments, in 24 layers) to ``--dir`` (a temporary folder by default), alternating A and B
each round:

* save, A: ``torch.distributed.checkpoint.save`` alone, what a trainer without checksums does;
* save, B: the same, then ``write_checksums`` (the sha256 of every file, ``checksums.json``), what
  ``qkwatch train`` does;
* load, A: ``torch.distributed.checkpoint.load`` with its default reader, which unpickles
  ``.metadata`` and the non-tensor values (the reader a crafted checkpoint runs code through);
* load, B: ``load_dcp``: every file's sha256 checked first, then the restricted reader.

The files are fresh in the page cache (just written), so the hash reads memory, not the disk: the
ratio is the hashing's worst case against a save or load that touched no disk either. sha256 runs
at one core's speed (about 0.5-2 GB/s); a checkpoint read cold from a network disk pays the disk,
which hides it. The machine's bare ``hashlib.sha256`` rate on one buffer is printed beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from qkwatch.trainer.checkpoints.safety import load_dcp, single_process_ok, write_checksums

LAYERS = 24


def state(megabytes: int) -> dict[str, Any]:
    """Weights and two optimizer moments, ``megabytes`` in all, float32."""
    per_tensor = megabytes * (1 << 20) // (3 * LAYERS) // 4
    side = int(per_tensor**0.5)
    torch.manual_seed(0)
    model = {f"layer.{i}.weight": torch.randn(side, side) for i in range(LAYERS)}
    optim = {k: {"exp_avg": torch.randn(side, side), "exp_avg_sq": torch.rand(side, side)} for k in model}
    return {"model": model, "optim": optim, "train": {"step": 1000, "lr": 3e-4}}


def empty_like(saved: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.empty_like(v) for k, v in saved["model"].items()},
        "optim": {k: {m: torch.empty_like(t) for m, t in v.items()} for k, v in saved["optim"].items()},
        "train": {"step": -1, "lr": 0.0},
    }


def seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_plain(saved: dict[str, Any], folder: Path) -> None:
    with single_process_ok():
        dcp.save(saved, checkpoint_id=str(folder))


def save_checked(saved: dict[str, Any], folder: Path) -> None:
    save_plain(saved, folder)
    write_checksums(folder)


def load_plain(saved: dict[str, Any], folder: Path) -> None:
    target = empty_like(saved)
    with single_process_ok():
        dcp.load(target, checkpoint_id=str(folder))
    assert torch.equal(target["model"]["layer.0.weight"], saved["model"]["layer.0.weight"])


def load_checked(saved: dict[str, Any], folder: Path) -> None:
    target = empty_like(saved)
    load_dcp(target, folder)
    assert torch.equal(target["model"]["layer.0.weight"], saved["model"]["layer.0.weight"])


def sha256_rate(megabytes: int) -> float:
    """GB/s of ``hashlib.sha256`` over one buffer in memory."""
    buffer = bytes(megabytes << 20)
    return len(buffer) / seconds(lambda: hashlib.sha256(buffer).hexdigest()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    saved = state(args.megabytes)
    size = sum(t.numel() * 4 for t in saved["model"].values()) * 3 / 1e9
    times: dict[str, list[float]] = {k: [] for k in ("save A", "save B", "load A", "load B")}
    try:
        for r in range(args.rounds):
            plain, checked = root / f"plain-{r}", root / f"checked-{r}"
            order = [("A", plain), ("B", checked)] if r % 2 == 0 else [("B", checked), ("A", plain)]
            for which, folder in order:
                save = save_plain if which == "A" else save_checked
                times[f"save {which}"].append(seconds(lambda s=save, f=folder: s(saved, f)))
            for which, folder in order:
                load = load_plain if which == "A" else load_checked
                times[f"load {which}"].append(seconds(lambda ld=load, f=folder: ld(saved, f)))
            shutil.rmtree(plain)
            shutil.rmtree(checked)
        print(f"checkpoint: {size:.2f} GB of float32 in {3 * LAYERS} tensors, {args.rounds} rounds, A/B alternating")
        print(f"bare hashlib.sha256 on this machine: {sha256_rate(256):.2f} GB/s (one core)")
        print("| step | A: without checksums (s) | B: with checksums (s) | B / A | added (s) |")
        print("|---|---|---|---|---|")
        for step, what in (("save", "save, then write_checksums"), ("load", "checksums checked, safe reader")):
            a, b = statistics.median(times[f"{step} A"]), statistics.median(times[f"{step} B"])
            print(f"| {step} ({what}) | {a:.2f} | {b:.2f} | {b / a:.2f} | {b - a:+.2f} |")
        print("medians over the rounds; every round:", {k: [round(v, 2) for v in vs] for k, vs in times.items()})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
