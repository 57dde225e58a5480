"""Property tests: every metric keeps its documented range and shape for any batch of heads."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkwatch.agent.metrics import (
    SPECTRUM_NAMES,
    STAT_NAMES,
    attention_spectrum,
    attention_stats,
    participation_ratio,
    qkai,
    stable_rank,
)

settings.register_profile("qkwatch", max_examples=40, deadline=None)
settings.load_profile("qkwatch")


@st.composite
def head_pairs(draw):
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n_kv = draw(st.integers(1, 3))
    n_rep = draw(st.integers(1, 3))
    d_head = draw(st.integers(1, 8))
    d_model = draw(st.integers(d_head, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    gen = torch.Generator().manual_seed(seed)
    wq = torch.randn(*lead, n_kv * n_rep, d_model, d_head, generator=gen) * scale
    wk = torch.randn(*lead, n_kv, d_model, d_head, generator=gen)
    return wq, wk


@given(head_pairs(), st.data())
def test_qkai_and_stable_rank_ranges_and_shapes(pair, data) -> None:
    wq, wk = pair
    d_head = wq.shape[-1]
    rank = data.draw(st.one_of(st.none(), st.integers(1, d_head)))
    a = qkai(wq, wk, rank=rank)
    s = stable_rank(wq, wk)
    assert a.shape == wq.shape[:-2] and s.shape == wq.shape[:-2]
    assert bool(((a >= -1e-5) & (a <= 1 + 1e-5)).all())
    assert bool(((s >= 1 - 1e-4) & (s <= d_head + 1e-3)).all())


@given(
    st.integers(1, 3),
    st.integers(1, 16),
    st.integers(1, 40),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_attention_stats_ranges(heads, t_q, extra_keys, d_head, causal, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    t_k = t_q + extra_keys
    q = torch.randn(heads, t_q, d_head, generator=gen) * 3
    k = torch.randn(heads, t_k, d_head, generator=gen)
    out = attention_stats(q, k, causal=causal)
    for name in STAT_NAMES:
        assert out[name].shape == (heads,), name
    for name in ("attn_entropy", "attn_top1", "attn_top5", "attn_gap"):
        assert bool(((out[name] >= -1e-5) & (out[name] <= 1 + 1e-5)).all()), name
    assert bool((out["attn_top5"] >= out["attn_top1"] - 1e-6).all())
    assert bool((out["qk_erank"] >= 1 - 1e-4).all() & (out["qk_erank"] <= min(t_q, d_head) + 1e-3).all())
    assert bool((out["logit_max"] >= out["logit_mean"] - 1e-5).all())
    assert bool((out["attn_entropy_nats"] >= -1e-5).all() & (out["attn_entropy_nats"] <= math.log(t_k) + 1e-5).all())


@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 8), st.booleans(), st.integers(0, 2**31 - 1))
def test_attention_spectrum_ranges(heads, t, d_head, causal, seed) -> None:
    """A row-stochastic A: srank in [1, T]; 1 <= sigma_1 <= sqrt(T), so gap in [0, sqrt(T)]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, t, d_head, generator=gen) * 3
    k = torch.randn(heads, t, d_head, generator=gen)
    out = attention_spectrum(q, k, causal=causal)
    for name in SPECTRUM_NAMES:
        assert out[name].shape == (heads,), name
    assert bool((out["attn_srank"] >= 1 - 1e-4).all() & (out["attn_srank"] <= t + 1e-3).all())
    assert bool((out["attn_gap1"] >= -1e-5).all() & (out["attn_gap1"] <= math.sqrt(t) + 1e-5).all())


@given(st.integers(2, 30), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_participation_ratio_range(n, width, seed) -> None:
    x = torch.randn(2, n, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    pr = participation_ratio(x)
    assert pr.shape == (2,)
    assert bool(((pr >= 1 - 1e-9) & (pr <= min(n - 1, width) + 1e-9)).all())
