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
from qkwatch.agent.models.adapters import AdapterError
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
        (FusedAttention, "layout=qkwatch.Layout(qkv='blocks.{i}.attn.qkv', split='qkv', n_heads=4)"),
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
    assert message.startswith(f"pass {line} to qkwatch.attach")  # the fix first, on one short line
    assert "\n" not in message and len(message) < 300, message
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

    with caplog.at_level(logging.WARNING, logger="qkwatch.agent.models.adapters"):
        a = agent.attach(WithAdapter(), spool=str(tmp_path), run="partly", **OFFLINE)
    assert [s.name for s in a.sites] == ["lm.transformer.h.0.attn", "lm.transformer.h.1.attn"]
    (warning,) = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    assert "monitors 2 attention layers and skips 1" in warning and "memory (MultiheadAttention)" in warning
    a.close(timeout=0.1)


def test_a_model_with_nothing_attention_like_says_so() -> None:
    with pytest.raises(
        AdapterError,
        match=r"^pass layout=qkwatch.Layout naming .*no attention layer in Sequential "
        r"\(attention-like modules: none; module types: Linear, ReLU, Sequential\)$",
    ):
        agent.attach(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), spool="/tmp/unused", **OFFLINE)


class RotaryAttention(nn.Module):
    """Llama-style: separate projections, RoPE on q and k, then an inner attention module called with
    (q, k, v) after it, as torchtitan's ``inner_attention``; ``n_kv_heads`` from a config the model holds."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        d, h, g = config.dim, config.n_heads, config.n_kv_heads
        self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, d * g // h), nn.Linear(d, d * g // h)
        self.inner_attention = Inner()
        self.h, self.g = h, g

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.h, -1).transpose(1, 2)
        k = self.wk(x).view(b, t, self.g, -1).transpose(1, 2)
        v = self.wv(x).view(b, t, self.g, -1).transpose(1, 2)
        q, k = q * rope, k * rope  # a stand-in rotation: position-dependent, so before and after differ
        return self.inner_attention(q, k, v).transpose(1, 2).reshape(b, t, d)


class Inner(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = (z.repeat_interleave(q.shape[1] // z.shape[1], dim=1) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Rotary(nn.Module):
    def __init__(self, t: int, hs: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(hs))
        self.t = t

    def forward(self) -> torch.Tensor:
        return 1.0 + torch.arange(self.t)[:, None].float() * self.inv_freq  # (T, hs)


class Config:
    dim, n_heads, n_kv_heads = 32, 4, 2


class RotaryStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = Config()
        self.emb = nn.Embedding(50, 32)
        self.rotary = Rotary(16, 8)
        self.layers = nn.ModuleList(nn.ModuleDict({"attention": RotaryAttention(self.config)}) for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, rope = self.emb(idx), self.rotary()
        for layer in self.layers:
            x = x + layer["attention"](x, rope)
        return x


def test_a_rotary_model_is_tapped_after_rope_with_its_configs_head_counts(tmp_path: Path) -> None:
    """The line names the config's n_kv_heads and the module called after RoPE; followed as written, the
    activation metrics are those of the rotated q and k (a Layout without ``tap`` is refused: its
    projections' outputs are not what the model attends)."""
    model = RotaryStack()
    with pytest.raises(AdapterError) as caught:
        agent.attach(model, spool=str(tmp_path / "no"), run="no", **OFFLINE)
    line = (
        "layout=qkwatch.Layout(q='layers.{i}.attention.wq', k='layers.{i}.attention.wk', n_heads=4, "
        "n_kv_heads=2, tap='layers.{i}.attention.inner_attention')"
    )
    assert suggested(caught.value) == line and str(caught.value).startswith(f"pass {line}")
    with pytest.raises(AdapterError, match=r"^add tap=.* or activations=False to the Layout: rotary \(Rotary\)"):
        agent.attach(model, layout=agent.Layout(q="layers.{i}.attention.wq", k="layers.{i}.attention.wk", n_heads=4))
    layout = eval(line.removeprefix("layout="), {"qkwatch": qkwatch})
    a = agent.attach(model, spool=str(tmp_path / "yes"), run="yes", every=1, layout=layout, **OFFLINE)
    a.step(0)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = model.layers[0]["attention"].inner_attention.register_forward_pre_hook(
        lambda m, args: captured.append((args[0], args[1]))
    )
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)))
    hook.remove()
    (report,) = [r for r in spooled(a) if r["layers"]]
    q, k = captured[0]
    logits = (q @ k.repeat_interleave(2, dim=1).mT) / math.sqrt(8)
    causal = torch.ones(16, 16).tril().bool()
    top1 = torch.softmax(logits.masked_fill(~causal, -math.inf), -1).amax(-1).mean().item()
    assert report["layers"]["attn_top1"][0] == pytest.approx(top1, abs=1e-5)


def test_a_fused_layout_must_say_its_split(tmp_path: Path) -> None:
    model = Stack(FusedAttention)
    with pytest.raises(AdapterError, match=r"^add split='qkv', 'per_head' or 'per_kv_head' to Layout\(qkv="):
        agent.attach(model, layout=agent.Layout(qkv="blocks.{i}.attn.qkv", n_heads=4), **OFFLINE)
    with pytest.raises(AdapterError, match=r"'interleaved' is none of them$"):
        agent.attach(model, layout=agent.Layout(qkv="blocks.{i}.attn.qkv", split="interleaved", n_heads=4), **OFFLINE)
