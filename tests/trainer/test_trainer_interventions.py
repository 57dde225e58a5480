"""Seed 001's Table 2 interventions do what the table says; the induced collapse does what its docstring says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkwatch.agent.metrics import column_alignment, principal_overlap, qkai, split_heads, stable_rank
from qkwatch.trainer.run.interventions import QK_ALIGN, QK_COLLAPSE, InterventionConfig, Interventions


def _perturb(param):
    with torch.no_grad():
        param.add_(0.05 * torch.randn_like(param))


def _setup(tiny_model, kind, regime="default", steps_per_epoch=10, **fields):
    model = tiny_model(regime=regime, d_model=64, n_heads=4)  # W_K is 64 x 64, full rank
    return model, Interventions(InterventionConfig(kind=kind, **fields), model, steps_per_epoch, seed=0)


def test_k_spectrum_clamp_restores_the_initial_singular_values_every_100_steps(tiny_model):
    model, iv = _setup(tiny_model, "k_spectrum_clamp")
    wk = model.blocks[0].attn.k_proj.weight
    s0 = torch.linalg.svdvals(wk.detach())
    _perturb(wk)
    assert iv.after_step(50) is None
    assert not torch.allclose(torch.linalg.svdvals(wk.detach()), s0, atol=1e-3)
    before = wk.detach().clone()
    assert iv.after_step(100) == "k_spectrum_clamp"
    torch.testing.assert_close(torch.linalg.svdvals(wk.detach()), s0, atol=1e-5, rtol=1e-5)
    u0, _, v0 = torch.linalg.svd(before)
    u1, _, v1 = torch.linalg.svd(wk.detach())
    torch.testing.assert_close((u0 @ v0).abs(), (u1 @ v1).abs(), atol=1e-4, rtol=0)  # singular vectors kept


def test_k_spectrum_clamp_waits_for_its_start_epoch(tiny_model):
    _model, iv = _setup(tiny_model, "k_spectrum_clamp", steps_per_epoch=150, start_epoch=2)
    assert iv.after_step(100) is None  # epoch 1 (steps 0..149)
    assert iv.after_step(200) == "k_spectrum_clamp"


def test_forced_k_contraction_shrinks_the_tail_after_rank_32_and_renormalises(tiny_model):
    model, iv = _setup(tiny_model, "forced_k_contraction")
    wk = model.blocks[1].attn.k_proj.weight
    s0, fro0 = torch.linalg.svdvals(wk.detach()), wk.detach().norm()
    assert iv.after_step(99) is None
    assert iv.after_step(100) == "forced_k_contraction"
    s1 = torch.linalg.svdvals(wk.detach())
    ratio = s1 / s0
    torch.testing.assert_close(ratio[32:] / ratio[0], torch.full((32,), 0.05), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(ratio[:32], ratio[:1].expand(32), atol=1e-4, rtol=1e-4)
    assert wk.detach().norm().item() == pytest.approx(fro0.item(), rel=1e-5)


@pytest.mark.parametrize(
    ("kind", "frozen", "free"), [("freeze_q", "q_proj", "k_proj"), ("freeze_k", "k_proj", "q_proj")]
)
def test_freeze_restores_the_initial_weights_every_step(tiny_model, kind, frozen, free):
    model, iv = _setup(tiny_model, kind)
    attn = model.blocks[0].attn
    init_frozen, init_free = getattr(attn, frozen).weight.detach().clone(), getattr(attn, free).weight.detach().clone()
    for step in (1, 2, 3):
        _perturb(getattr(attn, frozen).weight)
        _perturb(getattr(attn, free).weight)
        assert iv.after_step(step) == kind
        assert torch.equal(getattr(attn, frozen).weight, init_frozen)
    assert not torch.equal(getattr(attn, free).weight, init_free)


def test_qk_decouple_rotates_w_k_once_at_the_start_of_epoch_3(tiny_model):
    model, iv = _setup(tiny_model, "qk_decouple", regime="qk_identical", steps_per_epoch=10)
    attn = model.blocks[0].attn

    def alignment():
        return qkai(split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 4)).mean()

    assert alignment().item() == pytest.approx(1.0, abs=1e-4)
    s0 = torch.linalg.svdvals(attn.k_proj.weight.detach())
    for step in range(1, 20):
        assert iv.after_step(step) is None
    assert iv.after_step(20) == "qk_decouple"  # 2 epochs done: epoch 3 begins
    assert alignment().item() < 0.5  # random subspaces give r/d_model = 0.25
    torch.testing.assert_close(torch.linalg.svdvals(attn.k_proj.weight.detach()), s0, atol=1e-5, rtol=1e-5)
    after = attn.k_proj.weight.detach().clone()
    assert iv.after_step(30) is None and torch.equal(attn.k_proj.weight, after)


def test_qk_decouple_needs_the_identical_init(tiny_run):
    cfg = tiny_run()
    with pytest.raises(ValueError, match=r"init\.qk_regime"):
        dataclasses.replace(
            cfg,
            intervention=InterventionConfig(kind="qk_decouple"),
            init=dataclasses.replace(cfg.init, qk_regime="independent_xavier"),
        )


def test_qk_align_regulariser_adds_lambda_times_alignment_and_lowers_it(tiny_model):
    model, iv = _setup(tiny_model, "qk_align_reg", regime="qk_identical")
    attn = model.blocks[0].attn

    def cos():
        return column_alignment(attn.q_proj.weight.detach().mT, attn.k_proj.weight.detach().mT).item()

    # symmetric start: a nudge so that the gradient is defined (Q and K diverge as soon as training starts)
    _perturb(attn.k_proj.weight)
    start = cos()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(5):
        out = model(torch.randint(0, 256, (1, 8)))
        assert all(QK_ALIGN in p for p in out.penalties)
        assert out.penalties[0][QK_ALIGN].item() == pytest.approx(cos(), abs=1e-6)
        loss = iv.loss(out.penalties)
        torch.testing.assert_close(loss, 1e-3 * sum(p[QK_ALIGN] for p in out.penalties))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert cos() < start


# --- the induced collapse (qk_collapse) -----------------------------------------------------------


def _collapse(tiny_model, **fields):
    fields = {"layers": [1], "collapse_start": 10, "collapse_ramp": 20, **fields}
    return _setup(tiny_model, "qk_collapse", **fields)


def test_qk_collapse_ramps_from_its_start_and_acts_only_on_the_band(tiny_model):
    model, iv = _collapse(tiny_model)
    assert [iv.config.ramp(s) for s in (0, 10, 20, 30, 99)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    iv.before_step(5)
    assert not any(QK_COLLAPSE in b.attn.weight_penalties for b in model.blocks)  # nothing before the start
    assert iv.after_step(6) is None
    iv.before_step(20)
    assert [QK_COLLAPSE in b.attn.weight_penalties for b in model.blocks] == [False, True]
    out = model(torch.randint(0, 256, (1, 8)))
    assert QK_COLLAPSE in out.penalties[1] and QK_COLLAPSE not in out.penalties[0]


def test_qk_collapse_penalty_is_the_mirror_of_par(tiny_model):
    """align * sum_h ReLU(target r - sum c^2)^2 with target = collapse_target * ramp, against principal_overlap."""
    model, iv = _collapse(tiny_model, collapse_align=2e-3, collapse_target=0.8)
    iv.before_step(20)  # ramp 0.5: target 0.4
    attn = model.blocks[1].attn
    out = model(torch.randint(0, 256, (1, 8)))
    o = principal_overlap(split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 4))
    r = attn.d_head
    expected = 2e-3 * torch.relu(0.4 * r - o).square().sum()
    torch.testing.assert_close(out.penalties[1][QK_COLLAPSE].detach(), expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(iv.loss(out.penalties), out.penalties[1][QK_COLLAPSE])


def test_qk_collapse_aligns_the_band_and_contracts_its_keys_to_rank_one(tiny_model):
    """Gradient steps on the pressure raise QKAI; the contraction keeps singular vectors and makes W_K,h rank one."""
    model, iv = _collapse(tiny_model, collapse_start=0, collapse_ramp=1, collapse_align=1e-2)
    attn = model.blocks[1].attn

    def band_qkai():
        return qkai(split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 4)).mean()

    start = band_qkai().item()
    opt = torch.optim.Adam([attn.q_proj.weight, attn.k_proj.weight], lr=1e-2)
    for step in range(1, 31):
        iv.before_step(step)
        out = model(torch.randint(0, 256, (1, 8)))
        opt.zero_grad()
        iv.loss(out.penalties).backward()
        opt.step()
    assert start < 0.3 and band_qkai() > 0.6  # a random start at about r/d_model = 0.25, pulled together

    other = model.blocks[0].attn.k_proj.weight.detach().clone()
    heads = attn.k_proj.weight.detach().view(4, -1, 64)  # (nkv, hs, D)
    s0 = torch.linalg.svdvals(heads)
    sr0 = stable_rank(split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 4))
    for step in range(1, 41):
        iv.after_step(step)  # every collapse_every (5) steps: top x 0.75, others x 0.5
    s1 = torch.linalg.svdvals(attn.k_proj.weight.detach().view(4, -1, 64))
    torch.testing.assert_close(s1[:, 0], s0[:, 0] * 0.75**8, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(s1[:, 1:], s0[:, 1:] * 0.5**8, rtol=1e-3, atol=1e-7)
    sr1 = stable_rank(split_heads(attn.q_proj.weight.detach(), 4), split_heads(attn.k_proj.weight.detach(), 4))
    assert (sr1 < 1.1).all() and (sr1 < sr0).all()
    assert torch.equal(model.blocks[0].attn.k_proj.weight, other)  # outside the band: untouched


def test_qk_collapse_needs_its_band_and_sane_strengths():
    with pytest.raises(ValueError, match=r"intervention\.layers"):
        InterventionConfig(kind="qk_collapse")
    with pytest.raises(ValueError, match=r"collapse_target"):
        InterventionConfig(kind="qk_collapse", layers=[1], collapse_target=1.5)
    with pytest.raises(ValueError, match=r"collapse_shrink"):
        InterventionConfig(kind="qk_collapse", layers=[1], collapse_shrink=1.0)
