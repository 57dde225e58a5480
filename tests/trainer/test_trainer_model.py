"""The GPT: every variant trains, the seams other components rely on, and the attention paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkwatch.trainer.model.config import VARIANTS, ModelConfig
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.normalisation import SigmaReparamLinear


def _loss(model: GPT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)
    logits = model(idx[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_runs_forward_and_backward(tiny_model, variant):
    model = tiny_model(variant=variant, key_rotation=4)
    loss = _loss(model)
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # one SGD step lowers the loss on the same batch: the gradients point somewhere useful
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    assert _loss(model) < loss


@pytest.mark.parametrize(
    "fields", [{"n_kv_heads": 2}, {"position": "learned", "bias": True}, {"tie_embeddings": False}]
)
def test_gqa_learned_positions_biases_untied(tiny_model, fields):
    model = tiny_model(**fields)
    _loss(model).backward()
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


def test_module_names_and_qk_seams(tiny_model):
    model = tiny_model(n_kv_heads=2, key_rotation=4)
    attn = model.blocks[1].attn
    keys = set(model.state_dict())
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"blocks.1.attn.{proj}.weight" in keys
        assert isinstance(getattr(attn, proj), torch.nn.Linear)
    assert (attn.n_heads, attn.n_kv_heads, attn.d_head) == (4, 2, 8)
    assert attn.key_rotation.vectors.shape == (2, 4, 8)
    wq, wk, rotation = attn.qk_weights()
    assert wq.shape == (32, 32) and wk.shape == (16, 32) and rotation.shape == (2, 8, 8)
    assert model.config.n_layers == 2 and model.config.d_head == 8 and model.config.n_kv_heads == 2

    seen = []
    handle = attn.qk_tap.register_forward_hook(lambda mod, args, out: seen.append((args[0].shape, args[1].shape)))
    model(torch.zeros(3, 10, dtype=torch.long))
    handle.remove()
    assert seen == [(torch.Size([3, 4, 10, 8]), torch.Size([3, 2, 10, 8]))]


def test_qk_tap_sees_keys_after_rope_and_rotation(tiny_model):
    """The tap's q . k / sqrt(d) are the logits attention really uses."""
    model = tiny_model(attention="explicit", key_rotation=4)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.key_rotation.vectors.normal_()  # a non-trivial rotation
    captured, scores = {}, {}
    attn.qk_tap.register_forward_hook(lambda mod, args, out: captured.update(q=out[0], k=out[1]))
    original = torch.Tensor.softmax

    def spy(self, dim):
        scores.setdefault("first", self)
        return original(self, dim)

    torch.Tensor.softmax = spy
    try:
        model(torch.randint(0, 256, (1, 12)))
    finally:
        torch.Tensor.softmax = original
    logits = captured["q"] @ captured["k"].transpose(-2, -1) / math.sqrt(attn.d_head)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(scores["first"].masked_fill(~causal, 0), logits.masked_fill(~causal, 0))


def test_explicit_attention_matches_sdpa(tiny_model):
    sdpa = tiny_model(attention="sdpa", n_kv_heads=2)
    explicit = GPT(ModelConfig(**{**sdpa.config.__dict__, "attention": "explicit"}))
    explicit.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 256, (2, 20))
    torch.testing.assert_close(explicit(idx).logits, sdpa(idx).logits, atol=1e-5, rtol=1e-5)


def test_outlier_removed_attention_subtracts_the_uniform_causal_row(tiny_model):
    model = tiny_model(variant="outlier_removed")
    attn = model.blocks[0].attn
    assert attn.path == "explicit"
    q, k, v = torch.randn(3, 1, 4, 6, 8).unbind(0)
    T = 6
    a = (q @ k.mT / math.sqrt(8)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf).softmax(-1)
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]  # row i: 1/(i+1) on its i+1 keys
    torch.testing.assert_close(attn._attend(q, k, v), (a - uniform) @ v)
    # each row of A - U sums to 0: the rank-one mean component is gone
    torch.testing.assert_close((a - uniform).sum(-1), torch.zeros(1, 4, T), atol=1e-6, rtol=0)


def test_outlier_removal_needs_the_explicit_path():
    with pytest.raises(ValueError, match=r"model\.attention=sdpa"):
        ModelConfig(variant="outlier_removed", attention="sdpa")


def test_sigma_reparam_layers_have_spectral_norm_gamma(tiny_model):
    model = tiny_model(variant="sigma_reparam")
    layers = [m for m in model.modules() if isinstance(m, SigmaReparamLinear)]
    assert len(layers) == 2 * 6  # q, k, v, o, fc_in, fc_out per block
    for layer in layers:
        spectral = torch.linalg.matrix_norm(layer.effective_weight().detach(), ord=2)
        assert spectral.item() == pytest.approx(layer.gamma.item(), rel=1e-2)


def test_rezero_starts_as_the_identity_map_and_deepnorm_is_post_norm(tiny_model):
    rezero = tiny_model(variant="rezero")
    x = torch.randn(2, 5, 32)
    block = rezero.blocks[0]
    out, _ = block(x, (rezero.rope_cos[:5], rezero.rope_sin[:5]))
    torch.testing.assert_close(out, x)
    deep = tiny_model(variant="deepnorm")
    out, _ = deep.blocks[0](x, (deep.rope_cos[:5], deep.rope_sin[:5]))
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)  # ends in a LayerNorm


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads"),
        ({"variant": "bogus"}, "model.variant"),
        ({"n_layers": 0}, "model.n_layers"),
        ({"d_head": 7}, "model.d_head"),
        ({"key_rotation": 3}, "model.key_rotation"),
    ],
)
def test_bad_model_config_names_the_key(fields, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ModelConfig(**fields)


def test_longer_sequence_than_the_model_takes_is_refused(tiny_model):
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model()(torch.zeros(1, 33, dtype=torch.long))
