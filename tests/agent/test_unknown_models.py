"""A model no adapter knows: the error names what it found and the one line that declares its layout,
and that line, followed as written, works. A model only partly known is monitored where it is known,
and the log names every attention module it skipped."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import qkwatch
from qkwatch import agent
from qkwatch.agent.adapters import AdapterError
from tests.agent.test_probe import OFFLINE, spooled


class FusedAttention(nn.Module):
    """A fused ``qkv`` projection, causal SDPA: the pattern of many research codebases."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hs)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class SplitAttention(nn.Module):
    """Separate ``to_q``/``to_k``/``to_v`` (diffusers' names), ``heads`` for the head count."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class Stack(nn.Module):
    def __init__(self, make: type[nn.Module], layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": make()}) for _ in range(layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block["attn"](x)
        return x


def suggested(error: AdapterError) -> str:
    found = re.search(r"(layout=qkwatch\.Layout\([^)]*\))", str(error))
    assert found, str(error)
    return found.group(1)


@pytest.mark.parametrize(
    ("make", "line"),
    [
        (FusedAttention, "layout=qkwatch.Layout(qkv='blocks.{i}.attn.qkv', n_heads=4)"),
        (SplitAttention, "layout=qkwatch.Layout(q='blocks.{i}.attn.to_q', k='blocks.{i}.attn.to_k', n_heads=2)"),
    ],
    ids=["fused qkv", "to_q and to_k"],
)
def test_the_error_shows_the_layout_line_and_following_it_works(
    make: type[nn.Module], line: str, tmp_path: Path
) -> None:
    model = Stack(make)
    with pytest.raises(AdapterError) as caught:
        agent.attach(model, spool=str(tmp_path / "no"), run="no", **OFFLINE)
    message = str(caught.value)
    assert f"blocks.0.attn ({make.__name__})" in message  # it names the attention modules it saw
    assert suggested(caught.value) == line
    layout = eval(line.removeprefix("layout="), {"qkwatch": qkwatch})  # followed exactly as written
    a = agent.attach(model, spool=str(tmp_path / "yes"), run="yes", every=1, layout=layout, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)))
    (report,) = [r for r in spooled(a) if r["layers"]]
    assert [s.name for s in a.sites] == [
        f"blocks.{i}.attn.{line.split('.attn.')[1].split(chr(39))[0]}" for i in range(3)
    ]
    for metric in ("qkai", "stable_rank", "attn_entropy", "pr_q"):
        values = report["layers"][metric]
        assert len(values) == 3 and all(isinstance(v, float) and math.isfinite(v) for v in values), metric


def test_a_partly_known_model_is_monitored_and_the_skipped_attention_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPT-2 with an extra attention block of the user's own beside it: the GPT-2 layers are
    monitored, and the log names the block it cannot measure."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class WithAdapter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64))
            self.memory = nn.MultiheadAttention(32, 4, batch_first=True)

    with caplog.at_level(logging.WARNING, logger="qkwatch.agent.adapters"):
        a = agent.attach(WithAdapter(), spool=str(tmp_path), run="partly", **OFFLINE)
    assert [s.name for s in a.sites] == ["lm.transformer.h.0.attn", "lm.transformer.h.1.attn"]
    (warning,) = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    assert "monitors 2 attention layers and skips 1" in warning and "memory (MultiheadAttention)" in warning
    a.close(timeout=0.1)


def test_a_model_with_nothing_attention_like_says_so() -> None:
    with pytest.raises(
        AdapterError, match=r"Attention-like modules here: none; module types: Linear, ReLU, Sequential"
    ):
        agent.attach(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), spool="/tmp/unused", **OFFLINE)
