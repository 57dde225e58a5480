"""Participation ratio, effective rank and column alignment against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import (
    column_alignment,
    effective_rank,
    participation_ratio,
    projection_norms,
    split_heads,
    split_qkv,
)


def test_effective_rank_of_flat_and_one_hot_spectra() -> None:
    assert effective_rank(torch.ones(7)).item() == pytest.approx(7.0)
    assert effective_rank(torch.tensor([3.0, 0.0, 0.0])).item() == pytest.approx(1.0)
    s = torch.tensor([2.0, 1.0, 1.0])
    p = s / s.sum()
    assert effective_rank(s).item() == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert effective_rank(torch.zeros(3)).isnan()


def test_participation_ratio_of_rank_k_and_isotropic_clouds() -> None:
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(40, 5, generator=gen, dtype=torch.float64)).Q  # 5 orthonormal dirs
    # coefficients with exactly equal, uncorrelated sample variance: a scaled Hadamard-like design
    coeff = torch.tensor(np.kron(np.eye(5), [[1.0], [-1.0]]), dtype=torch.float64)  # (10, 5), centred
    cloud = coeff @ basis.T + 3.0  # offset: the covariance is centred
    assert participation_ratio(cloud).item() == pytest.approx(5.0, abs=1e-10)
    # isotropic Gaussian, n >> width: PR -> width * n / (n + width) (Marchenko-Pastur second moment)
    n, width = 4000, 64
    x = torch.randn(n, width, generator=gen, dtype=torch.float64)
    assert participation_ratio(x).item() == pytest.approx(width * n / (n + width), rel=0.03)
    # both Gram orientations agree (n < width uses the n x n Gram)
    y = torch.randn(3, 20, 50, generator=gen, dtype=torch.float64)
    cov_eigs = torch.linalg.eigvalsh(torch.cov(y[1].T))
    assert participation_ratio(y)[1].item() == pytest.approx((cov_eigs.sum() ** 2 / (cov_eigs**2).sum()).item())


def plug_in_expectation(eigenvalues: torch.Tensor, n: int) -> float:
    """``PR / (1 + (1 + PR) / n')``, ``n' = n - 1``: from E tr(S) = tr(Sigma) and the Wishart second
    moment E tr(S^2) = tr(Sigma^2) (1 + 1/n') + tr(Sigma)^2 / n'."""
    pr = (eigenvalues.sum() ** 2 / eigenvalues.square().sum()).item()
    return pr / (1 + (1 + pr) / (n - 1))


@pytest.mark.parametrize(
    ("n", "reps", "want"),
    [(64, 64, 256 * 63 / (63 + 257)), (4096, 4, 256 * 4095 / (4095 + 257))],  # 50.4 and 240.9
)
def test_participation_ratio_bias_of_isotropic_rows(n: int, reps: int, want: float) -> None:
    """Isotropic width 256 (true PR 256): 64 rows read about 50, 4,096 rows about 241.

    Mean of ``reps`` draws (fixed seed); over seeds 0-5 the mean stays within 0.1 % of the formula,
    the tolerance is 0.3 %.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(reps, n, 256, generator=gen, dtype=torch.float64)
    assert plug_in_expectation(torch.ones(256, dtype=torch.float64), n) == pytest.approx(want)
    assert participation_ratio(x).mean().item() == pytest.approx(want, rel=3e-3)


@pytest.mark.parametrize(("n", "reps"), [(64, 64), (4096, 8)])
def test_participation_ratio_bias_of_an_anisotropic_spectrum(n: int, reps: int) -> None:
    """Covariance eigenvalues exp(-i / 32), i < 256: PR = 63.96 (closed form of the geometric sums).

    Mean of ``reps`` draws against the bias formula (31.5 from 64 rows, 63.0 from 4,096); over seeds
    0-5 the mean stays within 0.5 %, the tolerance is 1 %.
    """
    r = math.exp(-1 / 32)
    pr = ((1 - r**256) / (1 - r)) ** 2 / ((1 - r**512) / (1 - r**2))
    eigenvalues = torch.exp(-torch.arange(256, dtype=torch.float64) / 32)
    assert (eigenvalues.sum() ** 2 / eigenvalues.square().sum()).item() == pytest.approx(pr, rel=1e-12)
    assert pr == pytest.approx(63.96, abs=0.01)
    basis = torch.linalg.qr(torch.randn(256, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64)).Q
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(reps, n, 256, generator=gen, dtype=torch.float64) * eigenvalues.sqrt()) @ basis.T  # rotated
    got = participation_ratio(x).mean().item()
    assert got == pytest.approx(plug_in_expectation(eigenvalues, n), rel=1e-2)
    if n == 4096:
        assert got == pytest.approx(pr, rel=0.03)  # many rows: within 2 % of the truth
    else:
        assert got < 0.55 * pr  # 64 rows: about half of it


def test_column_alignment_of_independent_xavier_matches_seed001() -> None:
    """Seed 001: independent Xavier at d_model 256 begins near 0.0498 = sqrt(2 / (pi * 256))."""
    gen = torch.Generator().manual_seed(0)
    bound = math.sqrt(6 / 512)
    wq = (torch.rand(8, 256, 256, generator=gen) * 2 - 1) * bound
    wk = (torch.rand(8, 256, 256, generator=gen) * 2 - 1) * bound
    value = column_alignment(wq, wk).mean().item()
    assert value == pytest.approx(0.0498, abs=0.0015)
    assert column_alignment(wq, wq).mean().item() == pytest.approx(1.0)


def test_projection_norms_and_non_finite() -> None:
    w = torch.diag(torch.tensor([3.0, 4.0, 0.0]))
    out = projection_norms(torch.stack([w, w.clone().fill_(math.nan)]))
    assert out["fro"][0].item() == pytest.approx(5.0) and out["spec"][0].item() == pytest.approx(4.0)
    assert all(v[1].isnan() for v in out.values())


def test_split_heads_and_fused_layouts() -> None:
    d_model, n_heads, d_head = 12, 3, 4
    linear = torch.arange(n_heads * d_head * d_model, dtype=torch.float32).reshape(n_heads * d_head, d_model)
    heads = split_heads(linear, n_heads)
    assert heads.shape == (3, 12, 4)
    assert torch.equal(heads[1], linear[4:8].T)  # head 1 = output rows 4..7, math layout
    fused = torch.randn(3 * d_model, d_model)  # nanoGPT c_attn: rows [q; k; v]
    q, k, v = split_qkv(fused, n_heads)
    assert torch.equal(k[2], fused[d_model + 8 : d_model + 12].T)
    q2, k2, v2 = split_qkv(fused.T.contiguous(), n_heads, conv1d=True)  # GPT-2 Conv1D
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    gqa = torch.randn((4 + 2 * 2) * 3, 12)
    q, k, v = split_qkv(gqa, 4, 2)
    assert q.shape == (4, 12, 3) and k.shape == (2, 12, 3)
    with pytest.raises(ValueError, match=r"do not split into 5 heads"):
        split_heads(linear, 5)
    with pytest.raises(ValueError, match=r"does not split into 4 query \+ 2 x 4"):
        split_qkv(torch.randn(20, 12), 4)
