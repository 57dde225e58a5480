"""Attaching never changes the model: logits and gradients bit for bit, in fp32 on the CPU.

Every adapter qkwatch ships (``adapters.FINDERS``) and an explicit layout, each with its attention
implementations: qkwatch's GPT (SDPA and explicit, GQA), nanoGPT, HuggingFace GPT-2, Llama with
GQA and BERT (bidirectional), each eager and sdpa, on unpadded, right-padded and left-padded
batches; and a left-padded generation batch. The reference is the same model, the same weights
and inputs, before the agent is attached; the attached forward runs on a report step (every
tap measures, which the test checks), so the hooks do all their work. A new adapter fails
``test_every_adapter_is_covered`` until it has a case here.

Flash attention needs a CUDA device; it is not run here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from qkwatch import agent
from qkwatch.agent.models.adapters import FINDERS
from qkwatch.agent.models.layouts import Layout
from tests.agent.test_probe import OFFLINE, spooled

VOCAB, T = 50, 12


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: one thread (the test compares bits, not speed), as before for the next test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    adapter: str
    """The finder in ``FINDERS`` that must find this model's layers, or ``layout``."""
    build: Callable[[], nn.Module]
    layout: Layout | None = None
    padded: bool = True
    """Takes an ``attention_mask`` (HuggingFace models)."""
    generates: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    fixtures: tuple[str, ...] = ()
    """Fixtures the model needs (Megatron-core's process group and CPU shims, ``tests/agent/conftest.py``)."""
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """How to call the model on token ids, when not ``model(x)``."""


def _gpt(attention: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from qkwatch.trainer.model.config import ModelConfig
        from qkwatch.trainer.model.gpt import GPT

        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=VOCAB, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=32, attention=attention
        )
        return GPT(config)

    return build


def _nanogpt() -> nn.Module:
    from qkwatch.nanogpt import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(vocab=VOCAB, n_layer=2)


def _hf(kind: str, attn: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import (
            BartConfig,
            BartForConditionalGeneration,
            BertConfig,
            BertModel,
            GPT2Config,
            GPT2LMHeadModel,
            LlamaConfig,
            LlamaForCausalLM,
        )

        torch.manual_seed(0)
        if kind == "bart":  # an encoder-decoder: two self-attention stacks (cross-attention left out)
            config = BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=0,
                attn_implementation=attn,
            )
            return BartForConditionalGeneration(config)
        if kind == "gpt2":
            config = GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn
            )
            config.pad_token_id = config.eos_token_id = config.bos_token_id = 0
            return GPT2LMHeadModel(config)
        if kind == "llama":
            config = LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
                attn_implementation=attn,
            )
            return LlamaForCausalLM(config)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            attn_implementation=attn,
        )
        return BertModel(config)

    return build


def _layout_gpt() -> nn.Module:
    return _gpt("sdpa")()


def _framework(builder: str, *args: Any) -> Callable[[], nn.Module]:
    """A model of ``tests/agent/test_frameworks.py`` (imported when built: that module imports this one)."""

    def build() -> nn.Module:
        from tests.agent import test_frameworks

        model: nn.Module = getattr(test_frameworks, builder)(*args)
        return model

    return build


def _megatron_call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Megatron's GPTModel takes positions and its mask (True: hidden) explicitly."""
    t = x.shape[1]
    hidden = ~torch.ones(1, 1, t, t, dtype=torch.bool).tril()  # [b, 1, s, s], as Megatron documents it
    out: torch.Tensor = model(x, torch.arange(t).repeat(x.shape[0], 1), hidden)
    return out


CASES: dict[str, Case] = {
    "gpt-sdpa": Case("adapters._qkwatch_gpt", _gpt("sdpa"), padded=False),
    "gpt-explicit": Case("adapters._qkwatch_gpt", _gpt("explicit"), padded=False),
    "nanogpt": Case("adapters._nanogpt", _nanogpt, padded=False),
    "layout": Case(
        "layout",
        _layout_gpt,
        layout=Layout(
            q="blocks.{i}.attn.q_proj",
            k="blocks.{i}.attn.k_proj",
            tap="blocks.{i}.attn.qk_tap",
            n_heads=4,
            n_kv_heads=2,
        ),
        padded=False,
    ),
    "torchtitan-sdpa": Case("frameworks.torchtitan", _framework("_titan", "sdpa", True), padded=False),
    "litgpt": Case("frameworks.litgpt", _framework("_litgpt"), padded=False),
    "megatron": Case(
        "frameworks.megatron",
        _framework("_megatron"),
        padded=False,
        fixtures=("megatron_on_cpu",),
        call=_megatron_call,
    ),
    "deepseek-mla": Case("frameworks.deepseek_mla", _framework("_deepseek", 16)),
    **{
        f"{kind}-{attn}": Case("hf_models.find", _hf(kind, attn), generates=kind in ("gpt2", "llama"))
        for kind in ("gpt2", "llama", "bert", "bart")
        for attn in ("eager", "sdpa")
    },
}

BATCHES = ("unpadded", "right-padded", "left-padded")


def _batch(padding: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(1, VOCAB, (3, T), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(x)
    if padding == "right-padded":
        mask[1, 8:] = 0
        mask[2, 5:] = 0
    elif padding == "left-padded":
        mask[1, :4] = 0
        mask[2, :7] = 0
    return x.masked_fill(mask == 0, 0), mask


def _forward(
    model: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    if call is not None:
        return call(model, x)
    out = model(x) if mask is None else model(input_ids=x, attention_mask=mask)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _logits_and_grads(
    model: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The outputs, and the gradient of a fixed random projection of them for every parameter."""
    model.zero_grad(set_to_none=True)
    out = _forward(model, x, mask, call)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    (out * weights).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]
    return [out.detach().clone(), *grads]


def _name(finder: Callable[..., object]) -> str:
    return f"{finder.__module__.rsplit('.', 1)[-1]}.{finder.__name__}"


def _found_by(model: nn.Module) -> str:
    for finder in FINDERS:
        if finder(model):
            return _name(finder)
    return "none"


def _attached(case: Case, model: nn.Module, tmp_path: Path, name: str) -> agent.Agent:
    a = agent.attach(model, spool=str(tmp_path / name), run=name, every=1, layout=case.layout, **OFFLINE)
    a.step(0)  # a report step: every tap measures on the next forward
    return a


def _measured_every_layer(a: agent.Agent) -> None:
    (report, *_) = [r for r in spooled(a) if r["layers"]]
    entropy = report["layers"]["attn_entropy"]
    assert len(entropy) == len(a.sites) and all(isinstance(v, float) and math.isfinite(v) for v in entropy)
    assert "events" not in report  # no layer missing


def test_every_adapter_is_covered() -> None:
    """Each finder qkwatch ships has a case here (a new adapter cannot skip this test), and each
    case's model is found by the finder it names."""
    assert {c.adapter for c in CASES.values()} == {_name(f) for f in FINDERS} | {"layout"}
    for name, case in CASES.items():
        if case.layout is None and not case.fixtures:  # Megatron's is checked where its fixtures run
            assert _found_by(case.build()) == case.adapter, name


@pytest.mark.parametrize(
    ("name", "padding"),
    [(n, p) for n, c in CASES.items() for p in BATCHES if c.padded or p == "unpadded"],  # only HF models take masks
)
def test_attach_leaves_logits_and_gradients_bit_identical(
    name: str, padding: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    case = CASES[name]
    for fixture in case.fixtures:
        request.getfixturevalue(fixture)
    model = case.build().eval()  # eval: no dropout between the two forwards
    x, mask = _batch(padding)
    use_mask = mask if case.padded else None
    before = _logits_and_grads(model, x, use_mask, case.call)
    a = _attached(case, model, tmp_path, name)
    after = _logits_and_grads(model, x, use_mask, case.call)
    _measured_every_layer(a)
    assert len(before) == len(after)
    for i, (b, c) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(b, c), (name, padding, "logits" if i == 0 else f"grad {i - 1}", (b - c).abs().max().item())
    again = _logits_and_grads(model, x, use_mask, case.call)  # closed: the model's own functions back in place
    assert all(torch.equal(b, c) for b, c in zip(before, again, strict=True))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.generates])
def test_a_left_padded_generation_batch_is_unchanged(name: str, tmp_path: Path) -> None:
    """Greedy generation from a left-padded batch: the same tokens and the same logits at every
    step (prefill, then decoding from the cache), with the agent attached and measuring."""
    case = CASES[name]
    model = case.build().eval()
    x, mask = _batch("left-padded")

    def generate() -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        return out.sequences, list(out.logits)

    tokens, logits = generate()
    a = _attached(case, model, tmp_path, name)
    tokens_after, logits_after = generate()
    _measured_every_layer(a)
    assert torch.equal(tokens, tokens_after)
    assert all(torch.equal(b, c) for b, c in zip(logits, logits_after, strict=True))
