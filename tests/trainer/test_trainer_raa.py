"""RAA: the PAR gradient, the Householder rotation, the schedule hookup, and zero cost when off."""

from __future__ import annotations

import logging

import pytest
import torch

from qkwatch.agent.metrics import effective_key_map, householder, par_penalty, principal_overlap, split_heads
from qkwatch.trainer.model.key_rotation import KeyRotation
from qkwatch.trainer.model.rank_anchored import PAR, RAAConfig, RAAController, ScheduleConfig


def layer_par(wq, wk, rotation=None, *, n_heads, n_kv_heads, rank=None):
    """PAR of ``nn.Linear``-layout projections, the key rotation folded in (``Wk R^T``) when given."""
    k = effective_key_map(split_heads(wk, n_kv_heads), rotation)  # (nkv, D, hs)
    return par_penalty(split_heads(wq, n_heads), k, rank, tau_factor=0.45)


def _aligned_pair(n_heads=2, d_model=12, d_head=4, noise=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randn(n_heads * d_head, d_model, generator=gen, dtype=torch.float64)
    wk = wq + noise * torch.randn(wq.shape, generator=gen, dtype=torch.float64)  # mostly aligned: PAR > 0
    return wq, wk


def test_par_gradient_matches_finite_differences():
    wq, wk = _aligned_pair()
    vectors = torch.randn(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def penalty(wq, wk, vectors):
        return layer_par(wq, wk, householder(vectors), n_heads=2, n_kv_heads=2)

    assert penalty(wq, wk, vectors) > 0.1
    assert torch.autograd.gradcheck(penalty, (wq.requires_grad_(), wk.requires_grad_(), vectors.requires_grad_()))


def test_par_gradient_with_gqa_and_top_r_subspaces():
    wq, _ = _aligned_pair(n_heads=4)
    wk = wq[:8] + 0.2 * torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def penalty(wq, wk):
        return layer_par(wq, wk, n_heads=4, n_kv_heads=2, rank=3)

    assert penalty(wq, wk) > 0
    assert torch.autograd.gradcheck(penalty, (wq.requires_grad_(), wk.requires_grad_()))


def test_par_ignores_the_key_rotation_because_the_subspace_is_the_same():
    """Why ``attention_par`` may leave the rotation out: ``Wk R^T`` spans ``Wk``'s column space."""
    wq, wk = _aligned_pair()
    vectors = torch.randn(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    kwargs = {"n_heads": 2, "n_kv_heads": 2}
    torch.testing.assert_close(layer_par(wq, wk, householder(vectors), **kwargs), layer_par(wq, wk, **kwargs))
    top = {**kwargs, "rank": 2}
    torch.testing.assert_close(layer_par(wq, wk, householder(vectors), **top), layer_par(wq, wk, **top))


def test_par_is_the_seed_formula():
    wq, wk = _aligned_pair()
    overlap = principal_overlap(split_heads(wq, 2), split_heads(wk, 2))  # sum_i c_i^2 per head
    expected = torch.relu(overlap - 0.45 * 4).square().sum()
    got = layer_par(wq, wk, n_heads=2, n_kv_heads=2)
    torch.testing.assert_close(got, expected)
    # a gradient step on PAR alone lowers the overlap: it pushes the subspaces apart
    wq.requires_grad_(), wk.requires_grad_()
    layer_par(wq, wk, n_heads=2, n_kv_heads=2).backward()
    with torch.no_grad():
        after = principal_overlap(split_heads(wq - 0.01 * wq.grad, 2), split_heads(wk - 0.01 * wk.grad, 2))
    assert (after < overlap).all()


def test_householder_rotation_is_orthogonal_and_the_identity_at_init(tiny_model):
    model = tiny_model(n_kv_heads=2, key_rotation=4)
    rotation = model.blocks[0].attn.key_rotation
    eye = torch.eye(8).expand(2, 8, 8)
    torch.testing.assert_close(rotation.matrix(), eye, atol=1e-6, rtol=0)
    k = torch.randn(3, 2, 5, 8)
    torch.testing.assert_close(rotation(k), k, atol=1e-6, rtol=0)

    free = KeyRotation(n_kv_heads=2, reflections=4, d_head=8)
    torch.nn.init.normal_(free.vectors)
    r = free.matrix()
    torch.testing.assert_close(r.mT @ r, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(r @ r.mT, eye, atol=1e-5, rtol=0)
    assert not torch.allclose(r, eye, atol=1e-2)
    # applying the reflections to the keys equals k <- R_g k with the matrix
    torch.testing.assert_close(free(k), k @ r.mT.unsqueeze(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(free(k).norm(dim=-1), k.norm(dim=-1), atol=1e-5, rtol=1e-5)  # norms kept


class _Advice:
    """A monitor that gives fixed lambdas and counts the calls (the agent gives the real ones)."""

    def __init__(self, lambdas):
        self.value, self.calls = lambdas, 0

    def lambdas(self):
        self.calls += 1
        return self.value


def test_lambdas_flag_layers_above_the_floor(tiny_model):
    model = tiny_model(n_layers=4)
    config = RAAConfig(enabled=True, schedule=ScheduleConfig(lambda_0=1e-3, floor=0.1))
    raa = RAAController(config, model.attentions())
    lambdas = raa.lambdas(_Advice([0.0, 2e-3, 1e-4, 5e-4]))
    assert lambdas == [0.0, 2e-3, 1e-4, 5e-4]
    assert raa.apply(lambdas, step=0) == [False, True, False, True]  # floor: 0.1 * lambda_0, exclusive
    assert [PAR in a.weight_penalties for a in model.attentions()] == [False, True, False, True]
    out = model(torch.randint(0, 256, (1, 8)))
    assert [PAR in p for p in out.penalties] == [False, True, False, True]
    total, terms = raa.loss(out.penalties, lambdas)
    torch.testing.assert_close(total, 2e-3 * out.penalties[1][PAR] + 5e-4 * out.penalties[3][PAR])
    assert terms[0] == 0.0 and terms[2] == 0.0
    raa.apply([0.0] * 4, step=1)
    assert not any(a.weight_penalties for a in model.attentions())


def test_no_advice_falls_back_to_lambda_0_loudly_and_bad_values_are_bounded(tiny_model, caplog):
    raa = RAAController(RAAConfig(enabled=True, schedule=ScheduleConfig(lambda_0=1e-3)), tiny_model().attentions())
    with caplog.at_level(logging.WARNING):
        assert raa.lambdas(_Advice(None)) == [1e-3, 1e-3]
        assert raa.lambdas(_Advice([1.0])) == [1e-3, 1e-3]  # wrong length
    assert sum("no-scheduling ablation" in r.message for r in caplog.records) == 1  # warned once
    assert raa.lambdas(_Advice([float("nan"), 1.0])) == [0.0, 0.1]  # per value: NaN -> 0, clipped to lambda_max
    unscheduled = RAAController(RAAConfig(enabled=True, scheduling=False), tiny_model().attentions())
    advice = _Advice([0.5, 0.5])
    assert unscheduled.lambdas(advice) == [1e-4, 1e-4] and advice.calls == 0
    fixed = RAAController(RAAConfig(enabled=True, fallback_lambdas=[0.0, 3e-4]), tiny_model().attentions())
    assert fixed.lambdas(_Advice(None)) == [0.0, 3e-4] and fixed.apply([0.0, 3e-4], 0) == [False, True]


def test_raa_off_costs_nothing(tiny_run, monkeypatch):
    """Disabled: no rotation module, the monitor is never asked, PAR never runs."""
    from qkwatch.trainer.model import rank_anchored
    from qkwatch.trainer.run.train import run

    cfg = tiny_run(steps=2, raa={"enabled": False})
    assert cfg.model_config().key_rotation == 0
    calls = []
    monkeypatch.setattr(rank_anchored, "par_penalty", lambda *a, **k: calls.append(1))

    class Recorder:
        lambda_source = None

        def __init__(self):
            self.asked = 0
            self.layers = []

        def step(self, step):
            pass

        def lambdas(self):
            self.asked += 1

        def log(self, step, **scalars):
            pass

        def log_layers(self, step, values):
            self.layers.append(values)

        def close(self, timeout=10.0, *, status="finished", reason=None):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, states):
            pass

    monitor = Recorder()
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        run(cfg, out, monitor=monitor)
    assert monitor.asked == 0 and not calls and not monitor.layers


def test_raa_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"raa\.reflections"):
        RAAConfig(reflections=3)
    with pytest.raises(ValueError, match=r"schedule\.lambda_0"):
        RAAConfig(schedule=ScheduleConfig(lambda_0=1.0, lambda_max=0.1))
    with pytest.raises(ValueError, match=r"raa\.tau_factor"):
        RAAConfig(tau_factor=1.5)


def test_the_folded_rotation_is_the_effective_key_map(tiny_model):
    """Keys come out as R_g W_k x: the projection with the rotation folded in, before RoPE."""
    model = tiny_model(n_kv_heads=2, key_rotation=4)
    attn = model.blocks[0].attn
    torch.nn.init.normal_(attn.key_rotation.vectors)
    x = torch.randn(2, 5, attn.k_proj.in_features)
    plain = attn.k_proj(x).view(2, 5, 2, attn.d_head)  # (B, T, G, d)
    r = attn.key_rotation.matrix()
    torch.testing.assert_close(
        attn._keys(x).view(2, 5, 2, attn.d_head), torch.einsum("gde,btge->btgd", r, plain), atol=1e-5, rtol=1e-5
    )
    _, wk, rotation = attn.qk_weights()  # what the agent and analyze use: Wk_h R_h^T in math layout
    from qkwatch.agent.metrics import effective_key_map, split_heads

    folded, _ = attn.key_rotation.fold(wk, None)
    torch.testing.assert_close(split_heads(folded, 2), effective_key_map(split_heads(wk, 2), rotation))


class _LossRecorder:
    """A monitor with no agent and no lambdas: keeps each step's loss (as the trainer logs it)."""

    lambda_source = None

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}

    def step(self, step: int) -> None:
        pass

    def lambdas(self) -> None:
        return None

    def log(self, step: int, **scalars) -> None:
        if "loss" in scalars:
            self.losses[step] = scalars["loss"].detach().clone()

    def log_layers(self, step: int, values) -> None:
        pass

    def close(self, timeout: float = 10.0, *, status: str = "finished", reason: str | None = None) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, states) -> None:
        pass


def test_raa_with_every_weight_at_zero_trains_exactly_as_vanilla(tiny_run, tmp_path):
    """RAA on with PAR on and every lambda 0 (fixed, no rotation) against RAA off: the same loss at
    every one of 6 steps and the same validation loss, bit for bit. The PAR term of a layer with
    lambda 0 is not computed at all (no layer is flagged), so nothing of it reaches the gradient.

    The Householder key rotation is left off on purpose: it is a model change (learned parameters
    folded into the key weights), not a weight of the loss."""
    from qkwatch.trainer.run.train import run

    n_layers = tiny_run().model.n_layers
    results, losses = [], []
    for name, raa in (
        ("vanilla", {"enabled": False}),
        ("raa-zero", {"enabled": True, "rotation": False, "scheduling": False, "fallback_lambdas": [0.0] * n_layers}),
    ):
        monitor = _LossRecorder()
        results.append(run(tiny_run(steps=6, raa=raa), tmp_path / name, monitor=monitor))
        losses.append(monitor.losses)
    assert sorted(losses[0]) == list(range(6))
    assert all(torch.equal(losses[0][s], losses[1][s]) for s in range(6)), (losses[0], losses[1])
    assert results[0].val_loss is not None and results[0].val_loss == results[1].val_loss
    with_par = _LossRecorder()  # the check can fail: a nonzero lambda moves the losses
    raa_on = {"enabled": True, "rotation": False, "scheduling": False, "fallback_lambdas": [1.0] * n_layers}
    run(tiny_run(steps=6, raa={**raa_on, "tau_factor": 0.05}), tmp_path / "raa-one", monitor=with_par)
    assert not torch.equal(losses[0][5], with_par.losses[5])
