"""Fused QKV projections split as each model splits them, and the attention of encoders, encoder-decoders
and bias-carrying models measured as the model computes it (issue 41).

Weights: every architecture below fuses its query, key and value projections into one matrix, each
ordering its rows its own way. The reference slices each head's query and key rows out of the fused
weight by hand, following the model's own forward code (quoted next to each), and the agent's per-head
factors must equal them exactly; the QKAI the agent reports must equal QKAI of the hand-sliced heads.
Each test also shows that the naive ``[q; k; v]`` reading gives another QKAI (what qkwatch reported
before), so a test that passed with the wrong split could not pass.

Activations: entropy, top-1 and top-5 mass against the model's own ``output_attentions`` probabilities
(eager, padded batches), as in ``test_model_scoring``: ALiBi (Falcon, Bloom), T5's relative bias
(encoder and decoder), Whisper's pre-scaled queries (encoder and decoder self-attention; its
cross-attention is skipped and named), ModernBERT's bidirectional local window, and the fused models.
Tiny random configs, nothing downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qkwatch import agent
from qkwatch.agent.metrics import split_qkv
from qkwatch.agent.metrics.summary import weight_metrics
from qkwatch.agent.models.adapters import find_sites
from tests.agent.test_invisible import one_thread  # noqa: F401 (a fixture)
from tests.agent.test_model_scoring import B, T, V, _common, _padded, reference, sharpen
from tests.agent.test_probe import OFFLINE, spooled

D, H, HS = 32, 4, 8

# --- the models, tiny ---------------------------------------------------------------------------


def _neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = GPTNeoXConfig(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=H, intermediate_size=64, max_position_embeddings=64
    )
    return GPTNeoXForCausalLM(_eager(c))


def _falcon(**kw: object) -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    c = FalconConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=H, max_position_embeddings=64, **kw)
    return FalconForCausalLM(_eager(c))


def _phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    c = Phi3Config(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return Phi3ForCausalLM(_eager(c))


def _bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(_eager(BloomConfig(hidden_size=D, n_layer=2, n_head=H)))


def _bigcode(multi_query: bool) -> nn.Module:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    c = GPTBigCodeConfig(n_embd=D, n_layer=2, n_head=H, n_positions=64, multi_query=multi_query)
    return GPTBigCodeForCausalLM(_eager(c))


def _modernbert() -> nn.Module:
    from transformers import ModernBertConfig, ModernBertModel

    c = ModernBertConfig(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=H,
        local_attention=6,  # a window of 3 keys either side on layer 1 (global_attn_every_n_layers=2)
        global_attn_every_n_layers=2,
        max_position_embeddings=64,
    )
    return ModernBertModel(_eager(c))


def _eager(config: object) -> object:
    common = _common()
    for name in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, name, common[name])
    config._attn_implementation = "eager"  # type: ignore[attr-defined]
    return config


def _per_head(w: torch.Tensor) -> torch.Tensor:
    """``(H*hs, D)`` rows, head after head -> ``(H, D, hs)``."""
    return w.reshape(-1, HS, w.shape[-1]).transpose(-1, -2)


# Each: (model, the fused module's path in layer i, the hand slicing of the model's forward code)
def _neox_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_gpt_neox: qkv.view(*input_shape, -1, 3 * head_size).chunk(3, dim=-1)
    rows = w.view(H, 3, HS, D)
    return rows[:, 0].transpose(-1, -2), rows[:, 1].transpose(-1, -2)


def _falcon_grouped_slice(w: torch.Tensor, g: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_falcon (new_decoder_architecture): view(..., num_kv_heads, -1, head_dim); [..., :-2] queries
    rows = w.view(g, H // g + 2, HS, D)
    return rows[:, :-2].reshape(H, HS, D).transpose(-1, -2), rows[:, -2].transpose(-1, -2)


def _falcon_mq_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_falcon (multi_query): fused_qkv.split([num_heads, 1, 1], dim=-2)
    return _per_head(w[: H * HS]), _per_head(w[H * HS : (H + 1) * HS])


def _phi3_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_phi3: query_pos = num_heads * head_dim; qkv[..., :query_pos], then num_key_value_heads * head_dim
    return _per_head(w[: H * HS]), _per_head(w[H * HS : (H + 2) * HS])


def _bigcode_mq_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_gpt_bigcode (multi_query): split((embed_dim, kv_dim, kv_dim))
    return _per_head(w[:D]), _per_head(w[D : D + HS])


def _modernbert_slice(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # modeling_modernbert: qkv.view(*input_shape, 3, -1, head_dim).unbind(dim=-3)
    rows = w.view(3, H, HS, D)
    return rows[0].transpose(-1, -2), rows[1].transpose(-1, -2)


FUSED: dict[str, tuple[Callable[[], nn.Module], str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]] = {
    "gpt-neox": (_neox, "gpt_neox.layers.{i}.attention.query_key_value", _neox_slice),
    "falcon-per-head": (
        lambda: _falcon(multi_query=False, new_decoder_architecture=False),
        "transformer.h.{i}.self_attention.query_key_value",
        _neox_slice,  # unflatten(-2, (num_heads, 3)): per head, as GPT-NeoX
    ),
    "falcon-multi-query": (
        lambda: _falcon(multi_query=True, new_decoder_architecture=False),
        "transformer.h.{i}.self_attention.query_key_value",
        _falcon_mq_slice,
    ),
    "falcon-grouped": (
        lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
        "transformer.h.{i}.self_attention.query_key_value",
        _falcon_grouped_slice,
    ),
    "phi3-gqa": (_phi3, "model.layers.{i}.self_attn.qkv_proj", _phi3_slice),
    "bloom": (_bloom, "transformer.h.{i}.self_attention.query_key_value", _neox_slice),  # view(b, t, H, 3, hs)
    "gpt-bigcode-multi-query": (lambda: _bigcode(True), "transformer.h.{i}.attn.c_attn", _bigcode_mq_slice),
    "gpt-bigcode": (lambda: _bigcode(False), "transformer.h.{i}.attn.c_attn", _neox_slice),  # view(..., -1, 3 hs)
    "modernbert": (_modernbert, "layers.{i}.attn.Wqkv", _modernbert_slice),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_qkv_splits_as_the_model_does(name: str, tmp_path: Path) -> None:
    build, path, by_hand = FUSED[name]
    torch.manual_seed(0)
    model = build().eval()
    sites = find_sites(model)
    assert len(sites) == 2
    modules = dict(model.named_modules())
    reference_qkai, naive_qkai = [], []
    for i, site in enumerate(sites):
        weight = modules[path.format(i=i)].weight.detach()
        wq_ref, wk_ref = by_hand(weight)
        wq, wk, _ = site.weights()
        assert torch.equal(wq, wq_ref) and torch.equal(wk, wk_ref), (name, i)
        reference_qkai.append(weight_metrics(wq_ref[None], wk_ref[None], None)[0]["qkai"].item())
        nq, nk, _ = split_qkv(weight, H, wk_ref.shape[0])  # [q; k; v]
        naive_qkai.append(weight_metrics(nq[None], nk[None], None)[0]["qkai"].item())
    a = agent.attach(model, spool=str(tmp_path), run="fused", every=1, **OFFLINE)
    a.step(0)
    x, mask = _padded()
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    assert report["layers"]["qkai"] == pytest.approx(reference_qkai, abs=1e-6)
    if not name.endswith(("multi-query", "phi3-gqa", "modernbert")):  # there [q; k; v] is the model's own order
        assert any(abs(n - r) > 1e-3 for n, r in zip(naive_qkai, reference_qkai, strict=True)), naive_qkai


# --- activations against the model's own probabilities -----------------------------------------


def _sharpen_fused(model: nn.Module, factor: float = 6.0) -> nn.Module:
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("query_key_value", "qkv_proj", "Wqkv", "c_attn"):
                module.weight.mul_(factor)
    return sharpen(model, factor)


def _falcon_alibi() -> nn.Module:
    return _falcon(alibi=True, multi_query=False, new_decoder_architecture=False)


CAUSAL: dict[str, Callable[[], nn.Module]] = {
    "falcon-alibi": _falcon_alibi,
    "bloom-alibi": _bloom,
    "gpt-neox": _neox,
    "phi3-gqa": _phi3,
    "gpt-bigcode-multi-query": lambda: _bigcode(True),
}


def _measured(model: nn.Module, tmp_path: Path, run: Callable[[], object]) -> dict[str, list[float]]:
    a = agent.attach(
        model, spool=str(tmp_path), run="families", every=1, sample_rows=4 * B * T, sample_seqs=B, **OFFLINE
    )
    a.step(0)
    with torch.no_grad():
        run()
    (report,) = spooled(a)
    layers: dict[str, list[float]] = report["layers"]
    return layers


def _check(layers: dict[str, list[float]], at: int, probs: torch.Tensor, real: np.ndarray) -> None:
    want = reference(probs, real)
    for metric, value in want.items():
        assert layers[metric][at] == pytest.approx(value, abs=2e-6), (metric, at)
    assert abs(want["attn_entropy"] - 1.0) > 0.02  # far from uniform: a wrong scale or bias would show


@pytest.mark.parametrize("name", list(CAUSAL))
def test_decoder_statistics_are_the_models_own(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _sharpen_fused(CAUSAL[name](), 10.0).eval()
    x, mask = _padded()
    layers = _measured(model, tmp_path, lambda: model(input_ids=x, attention_mask=mask))
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    assert len(probs) == len(layers["attn_entropy"]) == 2
    for at, p in enumerate(probs):
        _check(layers, at, p, mask.numpy())


def test_modernbert_bidirectional_local_window(tmp_path: Path) -> None:
    """Layer 0 attends globally, layer 1 within 3 keys either side, both bidirectional: a row's
    keys are those the model gave weight, so both the window and the missing causal mask show."""
    torch.manual_seed(0)
    model = _sharpen_fused(_modernbert()).eval()
    x, mask = _padded()
    layers = _measured(model, tmp_path, lambda: model(input_ids=x, attention_mask=mask))
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    window = (probs[1][1, 0] > 0).sum(-1)  # sequence 1 is whole: 4 to 7 keys a row
    assert window.max().item() == 7 and (probs[0][1, 0, 0] > 0).sum().item() == T  # row 0 sees every key
    for at, p in enumerate(probs):
        _check(layers, at, p, mask.numpy())


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    c = T5Config(
        d_model=D,
        d_kv=HS,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=H,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(_eager(c))


def test_t5_relative_bias_encoder_and_decoder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = sharpen(_t5(), 1.5).eval()  # T5 does not scale its logits: sharpened more, float32 probabilities underflow
    x, mask = _padded()
    y = torch.randint(1, V, (B, 7), generator=torch.Generator().manual_seed(6))
    y_mask = torch.ones_like(y)
    y_mask[2, 5:] = 0  # the decoder's own padding, on the right

    def run() -> object:
        return model(input_ids=x, attention_mask=mask, decoder_input_ids=y, decoder_attention_mask=y_mask)

    names = [s.name for s in find_sites(model)]
    assert names == [f"{stack}.block.{i}.layer.0.SelfAttention" for stack in ("decoder", "encoder") for i in (0, 1)]
    layers = _measured(model, tmp_path, run)
    with torch.no_grad():
        out = model(
            input_ids=x,
            attention_mask=mask,
            decoder_input_ids=y,
            decoder_attention_mask=y_mask,
            output_attentions=True,
        )
    for i in (0, 1):
        _check(layers, i, out.decoder_attentions[i], y_mask.numpy())
        _check(layers, 2 + i, out.encoder_attentions[i], mask.numpy())


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    c = WhisperConfig(
        d_model=D,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=H,
        decoder_attention_heads=H,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=0,
    )
    return WhisperForConditionalGeneration(_eager(c))


def test_whisper_encoder_and_decoder_self_attention(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whisper pre-scales its queries and calls its attention with ``scaling=1.0``; its decoder's
    cross-attention is left out and named in the log."""
    torch.manual_seed(0)
    model = sharpen(_whisper(), 12.0).eval()
    features = torch.randn(B, 8, 32, generator=torch.Generator().manual_seed(7))
    y = torch.randint(1, V, (B, 7), generator=torch.Generator().manual_seed(6))
    y_mask = torch.ones_like(y)
    y_mask[1, 4:] = 0

    def run() -> object:
        return model(input_features=features, decoder_input_ids=y, decoder_attention_mask=y_mask)

    names = [s.name for s in find_sites(model)]
    assert names == [f"model.{stack}.layers.{i}.self_attn" for stack in ("decoder", "encoder") for i in (0, 1)]
    with caplog.at_level("WARNING"):
        layers = _measured(model, tmp_path, run)
    assert "model.decoder.layers.0.encoder_attn (WhisperAttention, cross-attention)" in caplog.text
    with torch.no_grad():
        out = model(input_features=features, decoder_input_ids=y, decoder_attention_mask=y_mask, output_attentions=True)
    for i in (0, 1):
        _check(layers, i, out.decoder_attentions[i], y_mask.numpy())
        _check(layers, 2 + i, out.encoder_attentions[i], np.ones((B, 16)))


def _logits_spy(monkeypatch: pytest.MonkeyPatch, module: object, seen: list[torch.Tensor]) -> None:
    """Record, per call of ``module``'s eager attention, the logits it softmaxes: ``q k^T scaling``
    plus its ``position_bias`` (T5) and additive mask (ALiBi lives there in Falcon), as that function adds them."""
    original = module.eager_attention_forward  # type: ignore[attr-defined]

    def spy(mod, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        scaling = kwargs.get("scaling")
        logits = (query.double() @ key.double().repeat_interleave(query.shape[1] // key.shape[1], 1).mT) * (
            query.shape[-1] ** -0.5 if scaling is None else scaling
        )
        bias = kwargs.get("position_bias")
        if bias is not None:
            logits = logits + bias.double()
        if attention_mask is not None:
            visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            logits = (logits + attention_mask.double().masked_fill(~visible, 0)).masked_fill(~visible, -torch.inf)
        seen.append(logits)
        return original(mod, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(module, "eager_attention_forward", spy)


def _logit_max(logits: torch.Tensor, real: torch.Tensor) -> float:
    """The agent's ``logit_max``: per sequence and head the largest logit of a real row over the keys
    it sees, averaged over sequences, then heads."""
    top = logits.masked_fill(~real.bool()[:, None, :, None], -torch.inf).amax((-2, -1))  # (B, H)
    return top.mean(0).mean().item()


def test_logit_max_carries_alibi_and_the_relative_bias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logit_max`` of Falcon with ALiBi and of T5's decoder, recomputed from the q, k, scaling, bias and
    mask each model passes its eager attention (a row's logits are known from its probabilities only up
    to a constant)."""
    from transformers.models.falcon import modeling_falcon
    from transformers.models.t5 import modeling_t5

    torch.manual_seed(0)
    falcon = _sharpen_fused(_falcon_alibi(), 10.0).eval()
    x, mask = _padded()
    seen: list[torch.Tensor] = []
    _logits_spy(monkeypatch, modeling_falcon, seen)
    layers = _measured(falcon, tmp_path / "falcon", lambda: falcon(input_ids=x, attention_mask=mask))
    assert len(seen) == 2
    for i, logits in enumerate(seen):
        assert layers["logit_max"][i] == pytest.approx(_logit_max(logits, mask), abs=1e-4)

    t5 = sharpen(_t5(), 1.5).eval()
    y = torch.randint(1, V, (B, 7), generator=torch.Generator().manual_seed(6))
    y_mask = torch.ones_like(y)
    y_mask[2, 5:] = 0
    seen.clear()
    _logits_spy(monkeypatch, modeling_t5, seen)
    layers = _measured(
        t5,
        tmp_path / "t5",
        lambda: t5(input_ids=x, attention_mask=mask, decoder_input_ids=y, decoder_attention_mask=y_mask),
    )
    # calls: encoder 0, 1; then per decoder block self, cross: decoder self-attention is calls 2 and 4
    decoder = [seen[2], seen[4]]
    for i, logits in enumerate(decoder):
        assert layers["logit_max"][i] == pytest.approx(_logit_max(logits, y_mask), abs=1e-4)
    for i, logits in enumerate(seen[:2]):
        assert layers["logit_max"][2 + i] == pytest.approx(_logit_max(logits, mask), abs=1e-4)
