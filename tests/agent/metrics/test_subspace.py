"""QKAI, the principal-angle overlap and stable rank against closed forms and float64 numpy.

The references here are written independently of the implementation: numpy SVDs of each head
(the textbook definition), never the Gram/Cholesky route the library takes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import (
    ACCURACY,
    RANDOMIZED_TOLERANCE,
    effective_key_map,
    householder,
    principal_overlap,
    qkai,
    split_heads,
    stable_rank,
)
from qkwatch.agent.metrics.subspace import geometry

RNG = np.random.default_rng(0)


def orthonormal(rows: int, cols: int, rng=RNG) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q


def pair_with_angles(d_model: int, cosines: np.ndarray, rng=RNG) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal U_Q, U_K (d_model x d) whose principal cosines are exactly ``cosines``."""
    d = len(cosines)
    basis = orthonormal(d_model, 2 * d, rng)
    a, b = basis[:, :d], basis[:, d:]
    return a, a * cosines + b * np.sqrt(1 - cosines**2)


def reference_qkai(wq: np.ndarray, wk: np.ndarray, r: int) -> float:
    uq = np.linalg.svd(wq, full_matrices=False)[0][:, :r]
    uk = np.linalg.svd(wk, full_matrices=False)[0][:, :r]
    c = np.linalg.svd(uq.T @ uk, compute_uv=False)
    return float(np.mean(c**2))


def reference_stable_rank(wq: np.ndarray, wk: np.ndarray) -> float:
    s = np.linalg.svd(wq @ wk.T, compute_uv=False)  # forms the d_model x d_model product
    return float((s**2).sum() / s[0] ** 2)


def t(x: np.ndarray, dtype=torch.float64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def test_identical_column_spaces_give_one() -> None:
    w = t(RNG.standard_normal((3, 4, 64, 16)))
    mix = t(RNG.standard_normal((3, 4, 16, 16)))  # invertible map inside each head
    assert torch.allclose(qkai(w, w @ mix), torch.ones(3, 4, dtype=torch.float64), atol=1e-10)


def test_disjoint_supports_give_zero() -> None:
    wq = torch.zeros(2, 64, 16, dtype=torch.float64)
    wk = torch.zeros(2, 64, 16, dtype=torch.float64)
    wq[:, :32] = t(RNG.standard_normal((2, 32, 16)))
    wk[:, 32:] = t(RNG.standard_normal((2, 32, 16)))
    assert torch.allclose(qkai(wq, wk), torch.zeros(2, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prescribed_principal_angles_give_mean_cos_squared(dtype) -> None:
    cosines = np.linspace(0.0, 1.0, 24)
    uq, uk = pair_with_angles(200, cosines)
    wq = uq @ RNG.standard_normal((24, 24))  # arbitrary bases of the same column spaces
    wk = uk @ RNG.standard_normal((24, 24))
    got = qkai(t(wq, dtype), t(wk, dtype))
    assert got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else ACCURACY
    assert abs(got.item() - np.mean(cosines**2)) < tol


def test_top_r_subspaces_match_numpy_svd() -> None:
    wq = RNG.standard_normal((5, 96, 32)) * np.linspace(3, 0.1, 32)
    wk = RNG.standard_normal((5, 96, 32)) * np.linspace(2, 0.2, 32)
    for r in (1, 4, 17, 32):
        got = qkai(t(wq), t(wk), rank=r, method="exact")
        want = [reference_qkai(wq[h], wk[h], r) for h in range(5)]
        np.testing.assert_allclose(got.numpy(), want, atol=1e-10)


def test_invariant_under_orthogonal_map_of_residual_stream() -> None:
    wq, wk = RNG.standard_normal((2, 4, 80, 20))
    rot = orthonormal(80, 80)
    for r in (None, 7):
        before = qkai(t(wq), t(wk), rank=r)
        after = qkai(t(rot @ wq), t(rot @ wk), rank=r)
        assert torch.allclose(before, after, atol=1e-10)
    assert torch.allclose(stable_rank(t(wq), t(wk)), stable_rank(t(rot @ wq), t(rot @ wk)), atol=1e-9)


def test_full_rank_invariant_under_invertible_maps_inside_a_head() -> None:
    wq, wk = RNG.standard_normal((2, 6, 80, 20))
    a, b = RNG.standard_normal((2, 6, 20, 20))
    assert torch.allclose(qkai(t(wq), t(wk)), qkai(t(wq @ a), t(wk @ b)), atol=1e-9)


def test_random_subspaces_average_r_over_d_model() -> None:
    # sum c_i^2 = tr(P_Q P_K). For a Haar-random rank-r projection P and fixed A,
    # E tr(A P) = r tr(A) / D and Var tr(A P) = 2 r (D-r) (tr(A^2) - tr(A)^2 / D) / (D (D-1) (D+2)).
    # With A = P_Q: E[qkai] = r / D and Var[qkai] = 2 (D-r)^2 / (D^2 (D-1) (D+2)) (r = 1 gives the
    # Beta(1/2, (D-1)/2) law of one squared cosine). n heads: the mean is within 5 standard errors,
    # and the sample variance (relative SE sqrt(2/(n-1)) ~ 7 %) within 30 %.
    d_model, d, n = 256, 32, 400
    w = torch.randn(2, n, d_model, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    values = qkai(w[0], w[1])
    var = 2 * (d_model - d) ** 2 / (d_model**2 * (d_model - 1) * (d_model + 2))
    assert abs(values.mean().item() - d / d_model) < 5 * math.sqrt(var / n)
    assert abs(values.var().item() - var) < 0.3 * var


def test_stable_rank_of_prescribed_spectrum() -> None:
    # M = Wq Wk^T with Wq = U A, Wk = V B and A B^T = X diag(s) Y^T (X, Y orthogonal): the singular
    # values of M are s exactly. B is a dense random matrix and A = X diag(s) Y^T B^{-T}, so neither
    # Gram (A^T A, B^T B) is diagonal and their Cholesky factors are full triangles: the core
    # Rq Rk^T differs from its transposes, and only the right one has the singular values s.
    s = np.array([4.0, 2.0, 2.0, 1.0, 0.5, 0.5, 0.25, 0.1])
    x, y = orthonormal(8, 8), orthonormal(8, 8)
    b = RNG.standard_normal((8, 8)) + 3 * np.eye(8)  # well conditioned: the closed form holds to ~1e-13
    a = x @ np.diag(s) @ y.T @ np.linalg.inv(b).T
    wq, wk = orthonormal(64, 8) @ a, orthonormal(64, 8) @ b
    lq, lk = np.linalg.cholesky(wq.T @ wq), np.linalg.cholesky(wk.T @ wk)
    below = np.tril_indices(8, -1)
    for chol in (lq, lk):  # full triangles, not diagonals
        assert np.abs(chol[below]).max() > 0.1 * np.abs(np.diag(chol)).max()
    for wrong in (lq @ lk.T, lq.T @ lk.T, lq @ lk):  # what a transposed core would measure
        sv = np.linalg.svd(wrong, compute_uv=False)
        assert abs((sv**2).sum() / sv[0] ** 2 - (s**2).sum() / 16.0) > 0.05
    assert abs(stable_rank(t(wq), t(wk)).item() - (s**2).sum() / 16.0) < 1e-12
    flat = stable_rank(t(orthonormal(64, 8)), t(orthonormal(64, 8)))
    assert abs(flat.item() - 8.0) < 1e-9  # all singular values equal -> d_head


def test_stable_rank_matches_forming_the_product() -> None:
    wq, wk = RNG.standard_normal((2, 3, 50, 10)) * np.logspace(0, -1, 10)
    got = stable_rank(t(wq), t(wk))
    np.testing.assert_allclose(got.numpy(), [reference_stable_rank(wq[h], wk[h]) for h in range(3)], rtol=1e-10)
    f32 = stable_rank(t(wq, torch.float32), t(wk, torch.float32))
    np.testing.assert_allclose(f32.numpy(), got.numpy(), rtol=1e-4)


@pytest.mark.parametrize("kappa", [1.0, 30.0, 1e3, 1e5, 1e8])
def test_float32_stays_within_accuracy_at_any_conditioning(kappa: float) -> None:
    """The cascade recomputes ill-conditioned heads, so float32 inputs keep ACCURACY.

    ACCURACY bounds the error from the computation, on the weights as given. Rounding the
    weights to float32 moves the answer too (by 3.6e-4 from the construction's exact value at
    kappa 1e8, when the smallest directions are of the size of the rounding): that is the input,
    not the computation, so the reference is numpy's float64 SVD of the very float32 weights.
    """
    cosines = np.sqrt(RNG.uniform(0, 1, 32))
    uq, uk = pair_with_angles(256, cosines)
    spectrum = np.logspace(0, -math.log10(kappa), 32)
    wq = uq @ (orthonormal(32, 32) * spectrum) @ orthonormal(32, 32)
    wk = uk @ RNG.standard_normal((32, 32))
    wq32, wk32 = t(wq, torch.float32), t(wk, torch.float32)
    got = qkai(wq32, wk32)
    want = reference_qkai(wq32.double().numpy(), wk32.double().numpy(), 32)
    assert abs(got.item() - want) < ACCURACY


def test_rank_deficient_and_non_finite_heads_give_nan_not_a_crash() -> None:
    w = torch.randn(4, 64, 8, dtype=torch.float64)
    wk = torch.randn(4, 64, 8, dtype=torch.float64)
    w[1, 3, 2] = math.nan
    w[2, :, 5] = w[2, :, 4]  # rank 7 < d_head
    w[3] = 0.0
    wk_inf = wk.clone()
    wk_inf[0, 0, 0] = math.inf
    out = qkai(w, wk)
    assert math.isfinite(out[0].item()) and out[1:].isnan().all()
    assert qkai(w[:1], wk_inf[:1]).isnan().all()
    assert stable_rank(w, wk)[1].isnan() and math.isfinite(stable_rank(w, wk)[2].item())


def test_grouped_query_attention_equals_repeated_keys() -> None:
    wq = torch.randn(3, 8, 64, 16, dtype=torch.float64)
    wk = torch.randn(3, 2, 64, 16, dtype=torch.float64)
    wk[:, 0] = wq[:, 1] @ torch.randn(16, 16, dtype=torch.float64)  # kv head 0 serves q heads 0-3
    expanded = wk.repeat_interleave(4, dim=1)
    got = qkai(wq, wk)
    assert got.shape == (3, 8)
    assert torch.allclose(got, qkai(wq, expanded), atol=1e-12)
    assert torch.allclose(got[:, 1], torch.ones(3, dtype=torch.float64))
    assert torch.allclose(stable_rank(wq, wk), stable_rank(wq, expanded), atol=1e-9)


def test_key_rotation_changes_the_bilinear_form_not_the_subspaces() -> None:
    wq = torch.randn(4, 64, 16, dtype=torch.float64)
    wk = torch.randn(4, 64, 16, dtype=torch.float64)
    rot = householder(torch.randn(4, 4, 16, dtype=torch.float64))
    wk_eff = effective_key_map(wk, rot)
    assert torch.allclose(qkai(wq, wk_eff), qkai(wq, wk), atol=1e-10)
    for h in range(4):  # the bilinear form is Wq R Wk^T
        m = (wq[h] @ rot[h] @ wk[h].T).numpy()
        s = np.linalg.svd(m, compute_uv=False)
        assert abs(stable_rank(wq[h], wk_eff[h]).item() - (s**2).sum() / s[0] ** 2) < 1e-9


def test_randomized_mode_within_stated_tolerance_given_a_gap() -> None:
    r, d = 8, 128
    spectrum = np.concatenate([np.linspace(10, 5, r), np.linspace(2.5, 0.1, d - r)])  # gap 0.5 at r
    heads = []
    for _ in range(6):
        heads.append(orthonormal(256, d) @ np.diag(spectrum) @ orthonormal(d, d))
    wq = t(np.stack(heads[:3]), torch.float32)
    wk = t(np.stack(heads[3:]), torch.float32)
    exact = qkai(wq, wk, rank=r, method="exact")
    approx = qkai(wq, wk, rank=r, method="randomized")
    assert (exact - approx).abs().max().item() < RANDOMIZED_TOLERANCE
    assert torch.allclose(qkai(wq, wk, rank=r), approx, rtol=0, atol=1e-6)  # auto picks randomised here
    state = torch.random.get_rng_state()
    qkai(wq, wk, rank=r, method="randomized")
    assert torch.equal(torch.random.get_rng_state(), state)  # the training run's RNG is untouched


@pytest.mark.parametrize("rank", [None, 3])
def test_overlap_gradients_pass_gradcheck(rank) -> None:
    wq = torch.randn(2, 12, 5, dtype=torch.float64, requires_grad=True)
    wk = torch.randn(2, 12, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: principal_overlap(a, b, rank, method="exact"), (wq, wk))


def test_overlap_gradient_through_grouped_heads() -> None:
    wq = torch.randn(4, 10, 3, dtype=torch.float64, requires_grad=True)
    wk = torch.randn(2, 10, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(principal_overlap, (wq, wk))


def test_seed001_initial_alignments() -> None:
    """Seed 001 Table 3 initial alignment: QK identical 1, disjoint-support Xavier 0."""
    gen = torch.Generator().manual_seed(0)
    d_model, n_heads = 256, 4
    xavier = math.sqrt(6 / (2 * d_model))
    w = (torch.rand(d_model, d_model, generator=gen) * 2 - 1) * xavier
    wq = split_heads(w, n_heads)
    assert torch.allclose(qkai(wq, wq), torch.ones(n_heads), atol=1e-5)
    wq_dis, wk_dis = torch.zeros(d_model, d_model), torch.zeros(d_model, d_model)
    wq_dis[:, :128] = w[:, :128]  # queries read input coordinates 0..127, keys 128..255
    wk_dis[:, 128:] = w[:, 128:]
    assert torch.allclose(qkai(split_heads(wq_dis, n_heads), split_heads(wk_dis, n_heads)), torch.zeros(n_heads))


def reference_qk_cos(wq: np.ndarray, wk: np.ndarray) -> float:
    """Mean over the head's columns j (its output features) of |cos(Wq[:, j], Wk[:, j])|."""
    cos = [abs(wq[:, j] @ wk[:, j]) / (np.linalg.norm(wq[:, j]) * np.linalg.norm(wk[:, j])) for j in range(wq.shape[1])]
    return float(np.mean(cos))


def test_geometry_matches_independent_float64_references() -> None:
    """What the agent reports, head by head, against numpy's float64 SVDs and column cosines.

    Float32 weights (as the agent reads them) of 3 layers, 4 query heads on 2 key heads (query
    head h reads key head h // 2), with one ill-conditioned head (recomputed by the cascade) and
    one nearly aligned pair; the references take the same float32 values, in float64.
    """
    layers, heads, kv, d_model, d_head = 3, 4, 2, 40, 10
    wq = RNG.standard_normal((layers, heads, d_model, d_head))
    wk = RNG.standard_normal((layers, kv, d_model, d_head))
    wq[1, 2] = wq[1, 2] @ np.diag(np.logspace(0, -5, d_head))  # kappa 1e5
    wk[2, 0] = wq[2, 1] @ RNG.standard_normal((d_head, d_head)) + 0.05 * RNG.standard_normal((d_model, d_head))
    wq32, wk32 = t(wq, torch.float32), t(wk, torch.float32)
    q, k = wq32.double().numpy(), wk32.double().numpy()
    geo, top4 = geometry(wq32, wk32), geometry(wq32, wk32, rank=4)
    for name in ("qkai", "stable_rank", "qk_cos"):
        assert geo[name].shape == (layers, heads) and geo[name].dtype == torch.float32
    for layer in range(layers):
        for h in range(heads):
            wq_h, wk_h = q[layer, h], k[layer, h // 2]
            at = (layer, h)
            assert abs(geo["qkai"][at].item() - reference_qkai(wq_h, wk_h, d_head)) < ACCURACY, at
            assert abs(top4["qkai"][at].item() - reference_qkai(wq_h, wk_h, 4)) < ACCURACY, at
            assert geo["stable_rank"][at].item() == pytest.approx(reference_stable_rank(wq_h, wk_h), rel=1e-5), at
            assert geo["qk_cos"][at].item() == pytest.approx(reference_qk_cos(wq_h, wk_h), abs=1e-6), at
    assert geo["qkai"][2, 1].item() > 0.95  # the nearly aligned pair reads as nearly aligned


@pytest.mark.parametrize(
    ("wq", "wk", "match"),
    [
        ((4, 64, 16), (4, 64, 8), r"\(64, 16\) vs \(64, 8\)"),
        ((4, 64, 16), (4, 32, 16), r"\(64, 16\) vs \(32, 16\)"),
        ((6, 64, 16), (4, 64, 16), r"6 query heads cannot share 4 key heads"),
        ((4, 8, 16), (4, 8, 16), r"d_head=16 exceeds d_model=8"),
        ((16,), (16,), r"must be \(\.\.\., d_model, d_head\)"),
    ],
)
def test_mismatched_shapes_raise_value_error_naming_them(wq, wk, match) -> None:
    with pytest.raises(ValueError, match=match):
        qkai(torch.randn(wq), torch.randn(wk))


def test_rank_and_method_are_validated() -> None:
    w = torch.randn(2, 32, 8)
    with pytest.raises(ValueError, match=r"rank must be in \[1, d_head=8\], got 9"):
        qkai(w, w, rank=9)
    with pytest.raises(ValueError, match="method must be"):
        qkai(w, w, method="fast")
    with pytest.raises(ValueError, match="compute dtype"):
        qkai(w, w, dtype=torch.float16)


@pytest.mark.parametrize("kappa", [1.0, 10.0, 1e3, 1e6])
def test_top_r_float32_stays_within_accuracy(kappa: float) -> None:
    r, d = 6, 24
    gap_spectrum = np.concatenate([np.logspace(0, -math.log10(kappa), r), np.full(d - r, 0.5 / kappa)])
    heads_q = [orthonormal(96, d) @ np.diag(gap_spectrum) @ orthonormal(d, d) for _ in range(3)]
    heads_k = [orthonormal(96, d) @ np.diag(gap_spectrum) @ orthonormal(d, d) for _ in range(3)]
    wq, wk = np.stack(heads_q), np.stack(heads_k)
    got = qkai(t(wq, torch.float32), t(wk, torch.float32), rank=r, method="exact")
    want = [
        reference_qkai(wq[h].astype(np.float32).astype(np.float64), wk[h].astype(np.float32).astype(np.float64), r)
        for h in range(3)
    ]
    np.testing.assert_allclose(got.numpy(), want, atol=ACCURACY)


def test_unrefined_overlap_agrees_on_well_conditioned_heads_and_never_syncs() -> None:
    wq, wk = torch.randn(2, 3, 4, 64, 16)
    refined = principal_overlap(wq, wk)
    quick = principal_overlap(wq, wk, refine=False)
    assert torch.allclose(refined, quick, atol=1e-4)
    wq[0, 1, 0, 0] = math.nan
    assert principal_overlap(wq, wk, refine=False)[0, 1].isnan().all()  # NaN heads still report NaN
    q = torch.randn(3, 40, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 40, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: principal_overlap(a, b, refine=False), (q, k))


def test_chunked_first_tier_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many heads on several torch threads run in chunks on worker threads: same values as one pass.

    Grouped heads (8 query heads on 2 key heads), an ill-conditioned head (refined in float64) and
    a non-finite one (NaN) lie in different chunks; torch.set_num_threads(1) turns chunking off.
    """
    import qkwatch.agent.metrics.cascade as cascade

    gen = torch.Generator().manual_seed(3)
    wq = torch.randn(12, 8, 96, 16, generator=gen)
    wk = torch.randn(12, 2, 96, 16, generator=gen)
    wq[4, 3] = wq[4, 3] @ torch.diag(torch.logspace(0, -4, 16))
    wk[9, 1, 0, 0] = math.nan
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        qg, kg, _ = cascade.group_heads(wq, wk)
        assert cascade._chunks(qg, kg) == 4
        chunked = geometry(wq, wk)
        torch.set_num_threads(1)
        assert cascade._chunks(qg, kg) == 1
        one_pass = geometry(wq, wk)
    finally:
        torch.set_num_threads(threads)
    for name in ("qkai", "stable_rank", "qk_cos"):
        assert torch.equal(chunked[name].isnan(), one_pass[name].isnan()), name
        assert chunked[name][9, 4:].isnan().all(), name
        torch.testing.assert_close(chunked[name].nan_to_num(), one_pass[name].nan_to_num(), rtol=1e-5, atol=1e-6)
