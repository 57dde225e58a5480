"""Training frameworks' own models, attached with no hint (issue 41, part 3): torchtitan's Llama 3
(sdpa, and FlexAttention over packed documents), litgpt's GPT, Megatron-core's GPTModel, and
DeepSeek's multi-head latent attention (transformers' ``deepseek_v3``).

Tiny random configs on the CPU, nothing downloaded. For each model:

* the weights: the report's ``qkai``, ``qkai_max``, ``stable_rank`` and ``qk_cos`` per layer equal
  ``weight_metrics`` of per-head factors sliced here by hand, following the framework's own forward
  code (torchtitan: its own ``FusedQKVLinear`` state-dict split into ``wq``/``wk``);
* the activations: ``attn_entropy``, ``attn_top1``, ``attn_top5`` and ``logit_max`` per layer equal
  those of the framework's own attention probabilities (Megatron's and DeepSeek's, read where the
  model computes them) or of probabilities recomputed from the q and k a spy captured where the model
  attends, after RoPE, with the model's scale and the mask it attends under (causal; torchtitan's
  FlexAttention: causal within each packed document, built here from the positions);
* attaching changes nothing: the logits bit for bit.

The query and key weights are multiplied (by 30 where the framework initialises them with std 0.02)
so that the attention is far from uniform and a wrong scale, split or mask shows.

Megatron-core 0.16's forward hard-codes CUDA in three places that are not attention: RoPE's
``inv_freq`` moved to ``torch.cuda.current_device()``, the default causal mask made on ``"cuda"``
(the test passes Megatron's usual explicit causal mask instead, as its ``pretrain_gpt`` does), and
the CUDA RNG tracker forked around attention dropout (eval: no dropout). The first and last are
replaced by CPU equivalents here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from qkwatch import agent
from qkwatch.agent.metrics.summary import weight_metrics
from qkwatch.agent.models.adapters import find_sites
from tests.agent.test_invisible import one_thread  # noqa: F401 (a fixture)
from tests.agent.test_model_scoring import reference
from tests.agent.test_probe import OFFLINE, spooled

V, B, T = 50, 2, 12
DIM, H, G = 32, 4, 2
HS = DIM // H
WEIGHT_METRICS = ("qkai", "qkai_max", "stable_rank", "qk_cos")
ROW_METRICS = ("attn_entropy", "attn_top1", "attn_top5")


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))


def _attach(model: nn.Module, tmp_path: Path, run: str) -> agent.Agent:
    a = agent.attach(model, spool=str(tmp_path / run), run=run, every=1, sample_rows=B * T, sample_seqs=B, **OFFLINE)
    a.step(0)
    return a


def _report(model: nn.Module, tmp_path: Path, run: str, forward: Callable[[], torch.Tensor]) -> tuple[dict, Any]:
    """The report of one attached forward, and that forward's output."""
    a = _attach(model, tmp_path, run)
    with torch.no_grad():
        out = forward()
    (report,) = spooled(a)
    a.close()
    return report, out


def _check_weights(report: dict, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``per_layer``: hand-sliced ``(wq (H, D, hs), wk (G, D, hs))`` of each layer."""
    assert len(report["layers"]["qkai"]) == len(per_layer)
    for layer, (wq, wk) in enumerate(per_layer):
        want, _ = weight_metrics(wq.detach(), wk.detach(), spectra=False)
        for name in WEIGHT_METRICS:
            assert report["layers"][name][layer] == pytest.approx(want[name].item(), rel=1e-5, abs=1e-6), (name, layer)


def _probs_and_top(
    q: torch.Tensor, k: torch.Tensor, seen: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, H, T, hs)``, ``k (B, H|G, T, hs)``, ``seen (B|1, 1|H, T, T)`` boolean: the
    probabilities, and per sequence and head the largest visible logit."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.mT) * scale
    hidden = logits.masked_fill(~seen, -math.inf)
    return torch.softmax(hidden, -1), hidden.amax((-2, -1))


def _check_rows(report: dict, layer: int, probs: torch.Tensor, top: torch.Tensor | None) -> dict[str, float]:
    want = reference(probs, np.ones((probs.shape[0], probs.shape[2]), dtype=int))
    for name, value in want.items():
        assert report["layers"][name][layer] == pytest.approx(value, abs=2e-6), (name, layer)
    if top is not None:
        assert report["layers"]["logit_max"][layer] == pytest.approx(top.mean(0).mean().item(), abs=1e-5), layer
    assert abs(want["attn_entropy"] - 1.0) > 0.05  # sharp enough that a wrong mask or scale would show
    return want


def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()[None, None]


def _sharpen(*weights: torch.Tensor, factor: float = 6.0) -> None:
    with torch.no_grad():
        for w in weights:
            w.mul_(factor)


@contextlib.contextmanager
def _spy_sdpa() -> Iterator[list[dict[str, Any]]]:
    """Every ``F.scaled_dot_product_attention`` call's q, k, mask, causality and scale."""
    seen: list[dict[str, Any]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append({"q": q, "k": k, **kwargs})
        return original(q, k, v, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _unchanged(model: nn.Module, tmp_path: Path, forward: Callable[[], torch.Tensor]) -> None:
    with torch.no_grad():
        before = forward().clone()
    report, after = _report(model, tmp_path, "unchanged", forward)
    assert "events" not in report and len(report["layers"]["attn_entropy"]) == 2
    assert torch.equal(before, after)


# --- torchtitan -------------------------------------------------------------------------------


def _titan(backend: str, fused: bool) -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(
        n_layers=2,
        dim=DIM,
        n_heads=H,
        n_kv_heads=G,
        hidden_dim=64,
        rope=ComplexRoPE.Config(dim=HS, max_seq_len=64, theta=10000, scaling="none"),
        fuse_qkv=fused,
        attn_backend="flex",
    )
    if backend == "sdpa":  # torchtitan's ScaledDotProductAttention module (causal, no masks)
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    init = {"weight": torch.nn.init.normal_}
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=V,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=V, param_init=init),
        layers=layers,
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    for layer in model.layers.values():
        qkv = layer.attention.qkv_linear
        _sharpen(*([qkv.wqkv.weight] if fused else [qkv.wq.weight, qkv.wk.weight]), factor=30.0)  # init std 0.02
    return model.eval()


def _titan_reference_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """torchtitan's own split: its state dict holds ``wq``/``wk`` even for a fused ``wqkv``."""
    state = model.state_dict()
    out = []
    for i in range(len(model.layers)):
        wq = state[f"layers.{i}.attention.qkv_linear.wq.weight"]  # (H hs, D): row h*hs + j
        wk = state[f"layers.{i}.attention.qkv_linear.wk.weight"]
        out.append((wq.view(H, HS, DIM).mT, wk.view(G, HS, DIM).mT))
    return out


def _packed_positions() -> torch.Tensor:
    """Sequence 0 one document; sequence 1 two packed documents (positions restart at 0)."""
    positions = torch.arange(T).repeat(B, 1)
    positions[1, 5:] = torch.arange(T - 5)
    return positions


@pytest.mark.parametrize("fused", [True, False], ids=["wqkv", "wq-wk"])
def test_torchtitan_sdpa(fused: bool, tmp_path: Path) -> None:
    model = _titan("sdpa", fused)
    x = _tokens()
    assert [s.name for s in find_sites(model)] == ["layers.0.attention", "layers.1.attention"]
    _unchanged(model, tmp_path, lambda: model(x))
    with _spy_sdpa() as calls:
        report, _ = _report(model, tmp_path, "titan", lambda: model(x))
    _check_weights(report, _titan_reference_weights(model))
    assert len(calls) == 2
    for layer, call in enumerate(calls):
        assert call["is_causal"] and call.get("scale") is None  # torchtitan's sdpa: causal, 1/sqrt(hs)
        probs, top = _probs_and_top(call["q"], call["k"], _causal(T), 1 / math.sqrt(HS))
        _check_rows(report, layer, probs, top)


def test_torchtitan_flex_attention_over_packed_documents(tmp_path: Path) -> None:
    """FlexAttention's BlockMask read as the model applies it: causal, and no key across the
    boundary of sequence 1's two packed documents (blocks of 128 would not say so)."""
    model = _titan("flex", True)
    x, positions = _tokens(), _packed_positions()
    masks = model.get_attention_masks(positions)
    _unchanged(model, tmp_path, lambda: model(x, positions, masks))
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [
        layer.attention.rope.register_forward_hook(lambda mod, args, out: captured.append(out))
        for layer in model.layers.values()
    ]
    report, _ = _report(model, tmp_path, "flex", lambda: model(x, positions, masks))
    for hook in hooks:
        hook.remove()
    _check_weights(report, _titan_reference_weights(model))
    doc = torch.cumsum((positions == 0).int(), dim=1)  # (B, T) document ids
    seen = _causal(T) & (doc[:, None, :, None] == doc[:, None, None, :])
    for layer, (q, k) in enumerate(captured):  # after RoPE, (B, L, N, H)
        probs, top = _probs_and_top(q.transpose(1, 2), k.transpose(1, 2), seen, 1 / math.sqrt(HS))
        want = _check_rows(report, layer, probs, top)
        causal_only, _ = _probs_and_top(q.transpose(1, 2), k.transpose(1, 2), _causal(T), 1 / math.sqrt(HS))
        assert reference(causal_only, np.ones((B, T), dtype=int))["attn_top1"] != pytest.approx(
            want["attn_top1"], abs=1e-4
        )  # the documents matter: a causal-only reading would differ


# --- litgpt -----------------------------------------------------------------------------------


def _litgpt() -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        n_layer=2,
        n_head=H,
        n_query_groups=G,
        n_embd=DIM,
        block_size=64,
        vocab_size=V,
        padded_vocab_size=V,
        rotary_percentage=1.0,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
    )
    torch.manual_seed(0)
    model = GPT(config)
    for block in model.transformer.h:
        _sharpen(block.attn.qkv.weight)
    return model.eval()


def test_litgpt(tmp_path: Path) -> None:
    model = _litgpt()
    x = _tokens()
    assert [s.name for s in find_sites(model)] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    _unchanged(model, tmp_path, lambda: model(x))
    with _spy_sdpa() as calls:
        report, _ = _report(model, tmp_path, "litgpt", lambda: model(x))
    # litgpt 0.5's CausalSelfAttention.forward: qkv(x).split((H hs, G hs, G hs)), each viewed (.., heads, hs)
    per_layer = []
    for block in model.transformer.h:
        w = block.attn.qkv.weight
        wq, wk = w[: H * HS], w[H * HS : (H + G) * HS]
        per_layer.append((wq.view(H, HS, DIM).mT, wk.view(G, HS, DIM).mT))
    _check_weights(report, per_layer)
    assert len(calls) == 2
    for layer, call in enumerate(calls):
        assert call["is_causal"] and call["attn_mask"] is None
        probs, top = _probs_and_top(call["q"], call["k"], _causal(T), call["scale"])
        _check_rows(report, layer, probs, top)


# --- Megatron-core ----------------------------------------------------------------------------


def _megatron() -> nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=DIM,
        num_attention_heads=H,
        num_query_groups=G,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        apply_query_key_layer_scaling=True,  # softmax_scale / layer_number, times layer_number in the softmax
    )
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=V,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
    for layer in model.decoder.layers:
        _sharpen(layer.self_attention.linear_qkv.weight, factor=30.0)  # init std 0.02
    return model.eval()


def test_megatron_gpt_model(megatron_on_cpu: None, tmp_path: Path) -> None:
    model = _megatron()
    x, positions = _tokens(), torch.arange(T).repeat(B, 1)
    hidden = ~_causal(T)  # Megatron's mask: True where a key is hidden

    def forward() -> torch.Tensor:
        return model(x, positions, hidden)

    assert [s.name for s in find_sites(model)] == [
        "decoder.layers.0.self_attention",
        "decoder.layers.1.self_attention",
    ]
    _unchanged(model, tmp_path, forward)
    probs: list[torch.Tensor] = []
    qk: list[tuple[torch.Tensor, torch.Tensor, float]] = []
    hooks = []
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        # the model's own probabilities: what its attention dropout is given, (b, np, sq, sk)
        hooks.append(core.attention_dropout.register_forward_hook(lambda m, args, out: probs.append(args[0])))
        scale = core.softmax_scale * core.scale_mask_softmax.scale
        hooks.append(
            core.register_forward_pre_hook(lambda m, args, s=scale: qk.append((args[0], args[1], s)))  # type: ignore[misc]
        )
    report, _ = _report(model, tmp_path, "megatron", forward)
    for hook in hooks:
        hook.remove()
    # Megatron's get_query_key_value_tensors: linear_qkv's rows as (groups, [H/G q heads; k; v] x hs)
    r = H // G
    per_layer = []
    for layer in model.decoder.layers:
        w = layer.self_attention.linear_qkv.weight.view(G, (r + 2) * HS, DIM)
        wq = w[:, : r * HS].reshape(H, HS, DIM)
        wk = w[:, r * HS : (r + 1) * HS]
        per_layer.append((wq.mT, wk.mT))
    _check_weights(report, per_layer)
    assert len(probs) == len(qk) == 2
    for layer, (p, (q, k, scale)) in enumerate(zip(probs, qk, strict=True)):
        assert scale == pytest.approx(1 / math.sqrt(HS))
        _, top = _probs_and_top(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), _causal(T), scale)  # [s, b, h, d]
        _check_rows(report, layer, p, top)


# --- DeepSeek MLA (transformers) ---------------------------------------------------------------


def _deepseek(q_lora_rank: int | None) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=V,
        hidden_size=DIM,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # dense MLPs: the attention is what is measured
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            norms = [attn.kv_a_layernorm.weight] + ([attn.q_a_layernorm.weight] if q_lora_rank else [])
            for norm in norms:  # not all ones: the norms' weights are part of the effective form
                norm.copy_(torch.rand(norm.shape, generator=torch.Generator().manual_seed(norm.numel())) + 0.5)
            _sharpen(attn.q_b_proj.weight if q_lora_rank else attn.q_proj.weight, attn.kv_b_proj.weight, factor=30.0)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-lora", "q-proj"])
def test_deepseek_mla(q_lora_rank: int | None, tmp_path: Path) -> None:
    """MLA's effective per-head form: ``Wq_h = W_qa^T diag(g_q) W_qb,h^T`` (or ``q_proj``'s rows)
    against ``[W_kva,nope^T diag(g_kv) W_kb,h^T | W_kva,rope^T]``, the RoPE part one key shared by
    every head; the row statistics are the model's own ``output_attentions``."""
    model = _deepseek(q_lora_rank)
    x = _tokens()
    nope, rope, latent = 8, 4, 12
    sites = find_sites(model)
    assert [s.name for s in sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert (sites[0].n_heads, sites[0].n_kv_heads, sites[0].d_head) == (H, H, nope + rope)
    _unchanged(model, tmp_path, lambda: model(x).logits)
    report, _ = _report(model, tmp_path, "mla", lambda: model(x).logits)
    per_layer = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if q_lora_rank:  # q_b_proj(q_a_layernorm(q_a_proj(x))), viewed (.., H, nope + rope)
            wq = attn.q_b_proj.weight @ torch.diag(attn.q_a_layernorm.weight) @ attn.q_a_proj.weight
        else:
            wq = attn.q_proj.weight
        kv_a = attn.kv_a_proj_with_mqa.weight  # compressed_kv = [latent | k_rot]
        kv_b = attn.kv_b_proj.weight.view(H, nope + 8, latent)  # per head [k_nope | v]
        k_nope = kv_b[:, :nope] @ torch.diag(attn.kv_a_layernorm.weight) @ kv_a[:latent]  # (H, nope, D)
        k_rot = kv_a[latent:][None].expand(H, rope, DIM)
        per_layer.append((wq.view(H, nope + rope, DIM).mT, torch.cat([k_nope, k_rot], dim=1).mT))
    _check_weights(report, per_layer)
    with torch.no_grad():
        probs = model(x, output_attentions=True).attentions
    for layer, p in enumerate(probs):
        _check_rows(report, layer, p, None)
