"""A tiny nanoGPT (Karpathy's layout: fused ``c_attn``, ``n_head``, SDPA) and a training loop for the agent tests.

Run as a script it trains with the agent attached and prints ``step N`` after each step::

    python -m tests.agent.tiny --steps 40 --every 1 --run r1 --spool DIR [--url URL] [--sleep 0.05]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from qkwatch.nanogpt import NanoGPT


class TinyGPT(NanoGPT):
    """The agent tests' default: vocabulary 64, width 32, 4 heads, 4 layers, context 64."""


def batch(step: int, vocab: int = 64, t: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (4, t), generator=gen)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One optimizer step on ``batch(step)``; the loss, detached."""
    x = batch(step)
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train(agent, model: nn.Module, steps: int, start: int = 0, sleep: float = 0.0, log=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(start, steps):
        agent.step(step)
        agent.log(step, loss=train_step(model, opt, step))
        if log is not None:
            print(f"step {step}", file=log, flush=True)
        if sleep:
            time.sleep(sleep)


def main() -> int:
    from qkwatch import agent

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--run", required=True)
    p.add_argument("--spool", required=True)
    p.add_argument("--url", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--close-timeout", type=float, default=30.0)
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(
        model,
        url=args.url,
        project="tests",
        run=args.run,
        spool=args.spool,
        every=args.every,
        spectra_every=0,
        flush_seconds=0.05,
        backoff_base=0.05,
        backoff_cap=0.5,
    )
    train(a, model, args.steps, args.start, args.sleep, log=sys.stdout)
    a.close(args.close_timeout)
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def exact_entropy(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean normalised entropy of full causal attention, every row with > 1 key (eager reference)."""
    t, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ent = torch.special.entr(p).sum(-1)[..., 1:] / torch.arange(2, t + 1).log()
    return ent.mean(-1)
