"""The attention a model computes, not a textbook one: its own scale, soft-cap, bias and window (issue 41).

The reference is the model's own attention probabilities (``output_attentions=True``, eager) on a
padded batch: per real query row the entropy normalised by the number of keys the model gave a
nonzero weight (its window, causality and padding, whatever they are), the top-1 and top-5 mass;
averaged as the agent averages (rows, then sequences, then heads). Every row of every sequence is
sampled, so the agent's value must equal the reference.

Tiny random configs, nothing downloaded. The query and key weights are multiplied by 6 so that the
attention is far from uniform and a wrong scale shows (at initialisation every model attends
almost uniformly, where any scale gives entropy 1).

* OPT pre-scales its queries and calls its attention with ``scaling=1.0``;
* Gemma 2 scales by ``query_pre_attn_scalar``, soft-caps its logits and slides a window;
* Mistral slides a window;
* a muP-style Llama scales by ``4 / d_head`` (its modules' ``scaling`` set so).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qkwatch import agent
from qkwatch.agent.metrics import attention_stats, scored_logits
from tests.agent.test_invisible import one_thread  # noqa: F401 (a fixture)
from tests.agent.test_probe import OFFLINE, spooled

V, B, T = 50, 3, 12


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence 0 left-padded (4 pads), sequence 1 whole, sequence 2 right-padded (5 pads)."""
    x = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    mask[2, 7:] = 0
    return x.masked_fill(mask == 0, 0), mask


def reference(probs: torch.Tensor, real: np.ndarray) -> dict[str, float]:
    """``probs (B, H, T_q, T_k)``, ``real (B, T_q)``: the agent's averages, from the model's probabilities."""
    p = probs.double().numpy()
    out: dict[str, list[list[float]]] = {"attn_entropy": [], "attn_top1": [], "attn_top5": []}
    for b in range(p.shape[0]):
        rows = np.flatnonzero(real[b])
        per_head: dict[str, list[float]] = {name: [] for name in out}
        for h in range(p.shape[1]):
            ent, top1, top5 = [], [], []
            for i in rows:
                row = p[b, h, i]
                n = int((row > 0).sum())
                ranked = np.sort(row)[::-1]
                top1.append(ranked[0])
                top5.append(ranked[:5].sum())
                if n > 1:
                    ent.append(-(row[row > 0] * np.log(row[row > 0])).sum() / math.log(n))
            per_head["attn_entropy"].append(np.mean(ent))
            per_head["attn_top1"].append(np.mean(top1))
            per_head["attn_top5"].append(np.mean(top5))
        for name in out:
            out[name].append(per_head[name])
    return {name: float(np.mean(np.mean(values, axis=0))) for name, values in out.items()}


def sharpen(model: nn.Module, factor: float = 6.0) -> nn.Module:
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "q", "k") and isinstance(module, nn.Linear):
                module.weight.mul_(factor)
    return model


def _common() -> dict[str, object]:
    return {"vocab_size": V, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "attn_implementation": "eager"}


def _opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        **_common(),
    )
    return OPTForCausalLM(config)


def _gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=4,  # scale 1/2, not 1/sqrt(8)
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        sliding_window=4,
        max_position_embeddings=64,
        **_common(),
    )
    return Gemma2ForCausalLM(config)


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        max_position_embeddings=64,
        **_common(),
    )
    return MistralForCausalLM(config)


def _mup_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **_common(),
    )
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.scaling = 4.0 / layer.self_attn.head_dim  # muP's 1/d (times a constant), not 1/sqrt(d)
    return model


DECODERS: dict[str, Callable[[], nn.Module]] = {
    "opt": _opt,
    "gemma2": _gemma2,
    "mistral-window": _mistral,
    "mup-llama": _mup_llama,
}


def _attach(model: nn.Module, tmp_path: Path) -> agent.Agent:
    a = agent.attach(model, spool=str(tmp_path), run="scoring", every=1, sample_rows=B * T, sample_seqs=B, **OFFLINE)
    a.step(0)
    return a


@pytest.mark.parametrize("name", list(DECODERS))
def test_row_statistics_are_the_models_own_probabilities(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = sharpen(DECODERS[name]()).eval()
    x, mask = _padded()
    a = _attach(model, tmp_path)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    a.close()
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    assert len(probs) == len(report["layers"]["attn_entropy"]) == 2
    for layer, p in enumerate(probs):
        want = reference(p, mask.numpy())
        for metric, value in want.items():
            assert report["layers"][metric][layer] == pytest.approx(value, abs=2e-6), (metric, layer)
        # the textbook 1/sqrt(d) would have read the attention differently (that is what the test is about)
        assert abs(want["attn_entropy"] - 1.0) > 0.02


def test_logit_max_is_the_soft_capped_scaled_logit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2, sharpened: the largest logit the agent reports per layer is, per sequence and head, the
    largest of ``2 tanh(q.k / 2 / 2)`` over the real rows and the keys each sees (scale 1/2 from
    query_pre_attn_scalar 4, soft-cap 2), averaged as the agent averages; recomputed here from the q, k
    and mask the model passed its attention (a row's logits are known only up to a constant from its
    probabilities). Never above the cap, which a textbook ``q.k / sqrt(8)`` overshoots."""
    from transformers.models.gemma2 import modeling_gemma2

    torch.manual_seed(0)
    model = sharpen(_gemma2(), 20.0).eval()
    x, mask = _padded()
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = modeling_gemma2.eager_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((query.double(), key.double(), attention_mask))
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", spy)
    a = _attach(model, tmp_path)  # wraps the spy: both see what the model passes
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    a.close()
    for layer, (q, k, m) in enumerate(seen):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        raw = q @ k.mT
        logits = 2.0 * torch.tanh(raw * 0.5 / 2.0)
        visible = m > torch.finfo(m.dtype).min / 2  # (B, 1, T, T)
        real = mask.bool()[:, None, :, None]
        top = logits.masked_fill(~(visible & real), -math.inf).amax((-2, -1))  # (B, H)
        assert report["layers"]["logit_max"][layer] == pytest.approx(top.mean(0).mean().item(), abs=1e-5)
        textbook = (raw / math.sqrt(8)).masked_fill(~(visible & real), -math.inf).amax((-2, -1)).mean().item()
        assert report["layers"]["logit_max"][layer] <= 2.0 < textbook


def test_scored_logits_is_the_eager_formula() -> None:
    raw = torch.tensor([[3.0, -8.0, 0.5]])
    assert torch.allclose(scored_logits(raw, 4), raw / 2)
    assert torch.allclose(scored_logits(raw, 4, scale=1.0, softcap=2.0), 2 * torch.tanh(raw / 2))
    bias = torch.tensor([[0.0, 1.0, -1.0]])
    assert torch.allclose(scored_logits(raw, 4, scale=0.5, bias=bias), raw * 0.5 + bias)
    # per layer of a stacked batch: a value per leading index; NaN caps nothing
    stacked = torch.stack([raw, raw])  # (2, 1, 3)
    out = scored_logits(stacked, 4, scale=torch.tensor([1.0, 0.5]), softcap=torch.tensor([math.nan, 1.0]))
    assert torch.allclose(out[0], raw) and torch.allclose(out[1], torch.tanh(raw * 0.5))
    with pytest.raises(ValueError, match="not over the leading dims"):
        scored_logits(stacked, 4, scale=torch.tensor([1.0, 2.0, 3.0]))


def test_a_bias_moves_the_statistics_as_the_model_would() -> None:
    """An ALiBi-like bias favouring the nearest key: the statistics equal those of logits with the bias added."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    bias = -0.7 * (torch.arange(5)[:, None] - torch.arange(5)[None, :]).clamp_min(0).float()  # (T, T)
    bias = bias.expand(2, 5, 5)[:, None]  # (H, 1, T, T) against q (H, T, hs): heads lead
    got = attention_stats(q[:, None], k[:, None], causal=True, bias=bias, erank=False)
    logits = (q @ k.mT) / math.sqrt(8) + bias[:, 0]
    allowed = torch.ones(5, 5).tril().bool()
    p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    assert torch.allclose(got["attn_top1"][:, 0], p.max(-1).values.mean(-1), atol=1e-6)
    assert torch.allclose(got["logit_max"][:, 0], logits.masked_fill(~allowed, -math.inf).amax((-2, -1)), atol=1e-6)
