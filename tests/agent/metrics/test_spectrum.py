"""Seed 003's stable rank and spectral gap of the square attention matrix, against closed forms and
an independent float64 numpy implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import SPECTRUM_NAMES, attention_spectrum

RNG = np.random.default_rng(5)


def attention_matrix(q: np.ndarray, k: np.ndarray, causal: bool) -> np.ndarray:
    """One head's ``T x T`` softmax attention, row by row."""
    t, d = q.shape
    a = np.zeros((t, t))
    for i in range(t):
        n = i + 1 if causal else t
        s = np.array([q[i] @ k[j] / math.sqrt(d) for j in range(n)])
        p = np.exp(s - s.max())
        a[i, :n] = p / p.sum()
    return a


def uniform_rows(t: int, causal: bool) -> np.ndarray:
    """``U``: row ``i`` uniform over the keys it sees (seed 003's ``1 1^T / T``; causal, ``1 / (i + 1)``)."""
    return (
        np.array([[1.0 / (i + 1) if j <= i else 0.0 for j in range(t)] for i in range(t)])
        if causal
        else (np.full((t, t), 1.0 / t))
    )


def spectrum(m: np.ndarray) -> dict[str, float]:
    s = np.linalg.svd(m, compute_uv=False)
    return {"attn_srank": float((s**2).sum() / s[0] ** 2), "attn_gap1": float(s[0] - s[1])}


def test_identity_attention_has_no_gap_and_full_stable_rank() -> None:
    """q_i = k_i = c e_i with c^2 / sqrt(d) = 1000: every row puts all its mass on its own key, A = I."""
    t = 12
    eye = torch.eye(t, dtype=torch.float64) * math.sqrt(1000 * math.sqrt(t))  # (T, d_head = T)
    for causal in (True, False):
        out = attention_spectrum(eye[None], eye[None], causal=causal)
        assert out["attn_srank"].item() == pytest.approx(t, rel=1e-12)
        assert out["attn_gap1"].item() == pytest.approx(0.0, abs=1e-12)


def test_uniform_non_causal_attention_is_rank_one() -> None:
    """q = 0: A = 1 1^T / T, sigma_1 = 1 and no other: gap 1, stable rank 1; A - 1 1^T / T = 0 has none."""
    q = torch.zeros(2, 16, 4, dtype=torch.float64)
    k = torch.randn(2, 16, 4, dtype=torch.float64)
    out = attention_spectrum(q, k, causal=False)
    assert torch.allclose(out["attn_srank"], torch.ones(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(out["attn_gap1"], torch.ones(2, dtype=torch.float64), atol=1e-12)
    removed = attention_spectrum(q, k, causal=False, remove_outlier=True)
    assert all(v.isnan().all() for v in removed.values())
    # the same in float32: the sampled-rows estimate read sigma_1 ~ sqrt(n / T), this reads 1
    out32 = attention_spectrum(q.float(), k.float(), causal=False)
    assert torch.allclose(out32["attn_gap1"], torch.ones(2), atol=1e-5)


@pytest.mark.parametrize("t", [1, 2, 7, 64])
def test_causal_uniform_attention_against_numpy_svd(t: int) -> None:
    """q = 0 under the causal mask: A_ij = 1 / (i + 1) for j <= i."""
    want = spectrum(uniform_rows(t, causal=True)) if t > 1 else {"attn_srank": 1.0, "attn_gap1": 1.0}
    q, k = torch.zeros(1, t, 8, dtype=torch.float64), torch.randn(1, t, 8, dtype=torch.float64)
    got64 = attention_spectrum(q, k)
    got32 = attention_spectrum(q.float(), k.float())
    for name in SPECTRUM_NAMES:
        assert got64[name].item() == pytest.approx(want[name], rel=1e-10), name
        assert got32[name].item() == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("causal", [True, False])
def test_random_attention_and_outlier_removed_against_numpy(causal: bool) -> None:
    heads, t, d = 3, 40, 16
    q = RNG.standard_normal((heads, t, d)) * 1.5
    k = RNG.standard_normal((heads, t, d))
    plain = attention_spectrum(torch.from_numpy(q), torch.from_numpy(k), causal=causal)
    removed = attention_spectrum(torch.from_numpy(q), torch.from_numpy(k), causal=causal, remove_outlier=True)
    removed32 = attention_spectrum(torch.from_numpy(q).float(), torch.from_numpy(k).float(), causal, True)
    for h in range(heads):
        a = attention_matrix(q[h], k[h], causal)
        want, want_removed = spectrum(a), spectrum(a - uniform_rows(t, causal))
        for name in SPECTRUM_NAMES:
            assert plain[name][h].item() == pytest.approx(want[name], rel=1e-9), name
            assert removed[name][h].item() == pytest.approx(want_removed[name], rel=1e-9), name
            assert removed32[name][h].item() == pytest.approx(want_removed[name], rel=2e-4), name


def test_seed003_regime_gap_and_outlier_removal() -> None:
    """Isotropic inputs, unit-variance logits, T = 128 (seed 003's setting at initialisation): sigma_1
    stands apart (a gap of about 0.5-0.7) and removing the outlier raises the stable rank."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 128, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(4, 128, 32, generator=gen, dtype=torch.float64)
    plain = attention_spectrum(q, k, causal=False)
    removed = attention_spectrum(q, k, causal=False, remove_outlier=True)
    assert bool((plain["attn_gap1"] > 0.4).all()) and bool((plain["attn_srank"] < 3).all())
    assert bool((removed["attn_srank"] > 2 * plain["attn_srank"]).all())
    assert bool((removed["attn_gap1"] < plain["attn_gap1"] / 2).all())


def test_causal_leading_block_is_the_attention_of_the_prefix() -> None:
    """The W x W top-left block of the causal T x T matrix is the W-token prefix's own attention
    matrix (row i sees only keys <= i), so measuring the prefix measures that block exactly."""
    t, w, d = 48, 20, 8
    q, k = RNG.standard_normal((t, d)) * 2, RNG.standard_normal((t, d))
    full = attention_matrix(q, k, causal=True)
    prefix = attention_matrix(q[:w], k[:w], causal=True)
    assert np.allclose(full[:w, :w], prefix, rtol=0, atol=1e-15)
    assert np.allclose(full[:w, w:], 0.0)  # nothing of the block's rows lies outside it
    got = attention_spectrum(torch.from_numpy(q[:w])[None], torch.from_numpy(k[:w])[None])
    for name, value in spectrum(full[:w, :w]).items():
        assert got[name].item() == pytest.approx(value, rel=1e-10), name
    # without the mask the prefix's matrix is its own softmax over W keys, not a block of the full one
    assert not np.allclose(attention_matrix(q, k, causal=False)[:w, :w], attention_matrix(q[:w], k[:w], False))


def test_grouped_query_heads_and_leading_dims() -> None:
    q = torch.randn(2, 8, 24, 16)
    k = torch.randn(2, 2, 24, 16)
    got = attention_spectrum(q, k, remove_outlier=True)
    want = attention_spectrum(q, k.repeat_interleave(4, dim=1), remove_outlier=True)
    for name in SPECTRUM_NAMES:
        assert got[name].shape == (2, 8)
        assert torch.allclose(got[name], want[name], rtol=1e-5), name


@pytest.mark.parametrize(("q", "k"), [((2, 10, 16), (2, 12, 16)), ((2, 10, 16), (2, 10, 8)), ((10,), (10,))])
def test_bad_shapes_raise_value_error(q, k) -> None:
    with pytest.raises(ValueError, match=r"attention_spectrum needs q and k of one shape"):
        attention_spectrum(torch.randn(q), torch.randn(k))
