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


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_head = n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d_model: int = 32, n_head: int = 4, n_layer: int = 4, block: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(step: int, vocab: int = 64, t: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (4, t), generator=gen)


def train(agent, model: nn.Module, steps: int, start: int = 0, sleep: float = 0.0, log=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(start, steps):
        agent.step(step)
        x = batch(step)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.log(step, loss=loss.detach())
        if log is not None:
            print(f"step {step}", file=log, flush=True)
        if sleep:
            time.sleep(sleep)


def main() -> int:
    import agent

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
