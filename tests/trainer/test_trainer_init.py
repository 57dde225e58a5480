"""Seed 001's initialisation regimes start where the paper says they start."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import column_alignment, qkai, split_heads


def _layer_geometry(model, layer):
    attn = model.blocks[layer].attn
    wq, wk = attn.q_proj.weight.detach(), attn.k_proj.weight.detach()
    return qkai(split_heads(wq, attn.n_heads), split_heads(wk, attn.n_kv_heads)), column_alignment(wq.mT, wk.mT)


def _seed001_model(tiny_model, regime, **fields):
    # seed 001's dimensions: d_model 256, 4 heads of 64, MLP 1024, context 128
    return tiny_model(regime=regime, n_layers=2, d_model=256, n_heads=4, d_mlp=1024, max_seq_len=128, **fields)


def test_qk_identical_starts_at_alignment_one(tiny_model):
    model = _seed001_model(tiny_model, "qk_identical")
    for layer in range(2):
        q_k_ai, cos = _layer_geometry(model, layer)
        torch.testing.assert_close(q_k_ai, torch.ones(4), atol=1e-4, rtol=0)
        assert cos.item() == pytest.approx(1.0, abs=1e-6)


def test_disjoint_support_starts_at_alignment_zero(tiny_model):
    model = _seed001_model(tiny_model, "disjoint_support_xavier")
    q_k_ai, cos = _layer_geometry(model, 0)
    torch.testing.assert_close(q_k_ai, torch.zeros(4), atol=1e-5, rtol=0)
    assert cos.item() == 0.0
    wq = model.blocks[0].attn.q_proj.weight.detach()
    assert wq.abs().sum(0)[128:].max() == 0 and wq.abs().sum(0)[:128].min() > 0  # Q reads only the first half


def test_independent_xavier_alignment_is_about_0_0498_at_256(tiny_model):
    """Each output feature j pairs row j of W_Q with row j of W_K (``nn.Linear`` layout): two
    independent vectors of n = 256 iid entries, whose |cos| has mean E|cos| = Gamma(n/2) /
    (sqrt(pi) Gamma((n + 1) / 2)) = 0.0499 for isotropic vectors (about sqrt(2 / (pi n)); uniform
    entries differ from it by O(1/n) relative, far inside the sampling error here). The cosines are
    computed here with numpy; the mean of 8 layers x 256 of them must lie within 4 of its own
    standard errors of the closed form, and the library's ``qk_cos`` must equal their mean per layer."""
    n = 256
    closed_form = math.exp(math.lgamma(n / 2) - math.lgamma((n + 1) / 2)) / math.sqrt(math.pi)
    cosines = []
    for seed in range(4):
        model = _seed001_model(tiny_model, "independent_xavier", seed=seed)
        for layer in range(2):
            attn = model.blocks[layer].attn
            wq, wk = (w.detach().double().numpy() for w in (attn.q_proj.weight, attn.k_proj.weight))
            cos = np.abs((wq * wk).sum(1)) / (np.linalg.norm(wq, axis=1) * np.linalg.norm(wk, axis=1))  # (256,)
            assert _layer_geometry(model, layer)[1].item() == pytest.approx(cos.mean(), abs=1e-6)
            cosines.append(cos)
    cosines = np.concatenate(cosines)
    standard_error = cosines.std(ddof=1) / math.sqrt(len(cosines))  # ~0.038 / sqrt(2048) ~ 8e-4
    assert abs(cosines.mean() - closed_form) < 4 * standard_error
    # E cos^2 = 1/n exactly for entries iid and symmetric about 0 (cross terms vanish; E x_i^2 / |x|^2 = 1/n)
    assert abs((cosines**2).mean() - 1 / n) < 4 * (cosines**2).std(ddof=1) / math.sqrt(len(cosines))
    q_k_ai, _ = _layer_geometry(_seed001_model(tiny_model, "independent_xavier"), 0)
    assert q_k_ai.mean().item() == pytest.approx(64 / 256, abs=0.05)  # random subspaces: r / d_model


def test_xavier_scale_and_gqa_copy(tiny_model):
    model = _seed001_model(tiny_model, "independent_xavier")
    wq = model.blocks[0].attn.q_proj.weight
    bound = math.sqrt(6 / (256 + 256))
    assert wq.abs().max() <= bound and wq.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    gqa = tiny_model(regime="qk_identical", n_heads=4, n_kv_heads=2)
    attn = gqa.blocks[0].attn
    wq_h, wk_h = split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 2)
    torch.testing.assert_close(wk_h, wq_h[::2])  # key head g = query head 2g


def test_regime_applies_only_to_its_layers(tiny_model):
    model = tiny_model(regime="qk_identical", n_layers=4, qk_layers=[1, 2])
    aligned = [_layer_geometry(model, i)[0].mean().item() for i in range(4)]
    assert aligned[1] == pytest.approx(1.0, abs=1e-4) and aligned[2] == pytest.approx(1.0, abs=1e-4)
    assert aligned[0] < 0.6 and aligned[3] < 0.6


def test_initialisation_depends_on_seed_and_name_only(tiny_model):
    a, b, c = tiny_model(seed=3), tiny_model(seed=3), tiny_model(seed=4)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
