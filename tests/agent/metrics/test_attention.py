"""Sampled attention statistics against an independent float64 numpy implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import STAT_NAMES, attention_stats, qk_erank

RNG = np.random.default_rng(3)


def reference(q: np.ndarray, k: np.ndarray, causal: bool, q_pos: np.ndarray) -> dict[str, float]:
    """One head, written from docs/metrics.md's table row by row with explicit loops."""
    d = q.shape[-1]
    rows = []
    logits_allowed = []
    for i, pos in enumerate(q_pos):
        n = pos + 1 if causal else k.shape[0]
        s = np.array([q[i] @ k[j] / math.sqrt(d) for j in range(n)])
        logits_allowed.extend(s)
        p = np.exp(s - s.max())
        p /= p.sum()
        ps = np.sort(p)[::-1]
        nats = -sum(x * math.log(x) for x in p if x > 0)
        ent = (nats / math.log(n), nats) if n > 1 else None
        rows.append((ent, ps[0], ps[:5].sum(), ps[0] - (ps[1] if n > 1 else 0.0)))
    ents = [r[0] for r in rows if r[0] is not None]
    raw = q @ k.T
    s_raw = np.linalg.svd(raw, compute_uv=False)
    p_sv = s_raw / s_raw.sum()
    la = np.array(logits_allowed)
    return {
        "attn_entropy": float(np.mean([e[0] for e in ents])),
        "attn_entropy_nats": float(np.mean([e[1] for e in ents])),
        "attn_top1": float(np.mean([r[1] for r in rows])),
        "attn_top5": float(np.mean([r[2] for r in rows])),
        "attn_gap": float(np.mean([r[3] for r in rows])),
        "logit_mean": float(la.mean()),
        "logit_std": float(la.std()),
        "logit_max": float(la.max()),
        "qk_erank": float(np.exp(-(p_sv[p_sv > 0] * np.log(p_sv[p_sv > 0])).sum())),
    }


@pytest.mark.parametrize("causal", [True, False])
def test_matches_independent_reference(causal: bool) -> None:
    heads, t_q, t_k, d = 3, 12, 40, 16
    q = RNG.standard_normal((heads, t_q, d)) * 1.5
    k = RNG.standard_normal((heads, t_k, d))
    got = attention_stats(torch.from_numpy(q), torch.from_numpy(k), causal=causal)
    assert set(got) == set(STAT_NAMES)
    q_pos = np.arange(t_k - t_q, t_k)
    for h in range(heads):
        want = reference(q[h], k[h], causal, q_pos)
        for name in STAT_NAMES:
            assert got[name][h].item() == pytest.approx(want[name], rel=1e-9, abs=1e-10), name


def test_sampled_rows_at_explicit_positions_and_float32() -> None:
    q = RNG.standard_normal((2, 6, 8))
    k = RNG.standard_normal((2, 30, 8))
    q_pos = np.array([0, 1, 4, 9, 17, 29])  # row 0 sees one key: skipped for entropy
    got = attention_stats(torch.from_numpy(q).float(), torch.from_numpy(k).float(), q_pos=torch.from_numpy(q_pos))
    for h in range(2):
        want = reference(q[h], k[h], True, q_pos)
        for name in STAT_NAMES:
            assert got[name][h].item() == pytest.approx(want[name], rel=2e-4, abs=2e-5), name


def test_uniform_rows_have_entropy_one_and_one_hot_rows_zero() -> None:
    t_k, d = 20, 4
    k = torch.randn(1, t_k, d, dtype=torch.float64)
    uniform = attention_stats(torch.zeros(1, 8, d, dtype=torch.float64), k)  # equal logits per row
    assert uniform["attn_entropy"].item() == pytest.approx(1.0, abs=1e-12)
    # in nats a uniform row over n_i keys has H = log n_i: rows 12..19 see 13..20 keys
    assert uniform["attn_entropy_nats"].item() == pytest.approx(np.mean(np.log(np.arange(13, 21))), abs=1e-12)
    # causal rows 12..19 see 13..20 keys: top1 = mean of 1/n
    assert uniform["attn_top1"].item() == pytest.approx(np.mean([1 / n for n in range(13, 21)]), abs=1e-12)
    keys = torch.zeros(1, t_k, d, dtype=torch.float64)
    keys[0, 0, 0] = 1.0
    one_hot = attention_stats(torch.full((1, 8, d), 1e4, dtype=torch.float64), keys)
    assert one_hot["attn_entropy"].item() == pytest.approx(0.0, abs=1e-9)
    assert one_hot["attn_entropy_nats"].item() == pytest.approx(0.0, abs=1e-9)
    assert one_hot["attn_top1"].item() == pytest.approx(1.0) and one_hot["attn_gap"].item() == pytest.approx(1.0)


def test_entropy_in_nats_skips_single_key_rows_and_matches_numpy() -> None:
    """Uniform rows at explicit positions (row 0 sees one key: skipped), then a random case in float32."""
    k = torch.randn(1, 30, 8, dtype=torch.float64)
    q_pos = torch.tensor([0, 1, 4, 9, 29])
    uniform = attention_stats(torch.zeros(1, 5, 8, dtype=torch.float64), k, q_pos=q_pos)
    assert uniform["attn_entropy_nats"].item() == pytest.approx(np.mean(np.log([2, 5, 10, 30])), abs=1e-12)
    non_causal = attention_stats(torch.zeros(1, 5, 8, dtype=torch.float64), k, causal=False)
    assert non_causal["attn_entropy_nats"].item() == pytest.approx(math.log(30), abs=1e-12)
    q = RNG.standard_normal((3, 10, 8)) * 2
    keys = RNG.standard_normal((3, 50, 8))
    got = attention_stats(torch.from_numpy(q).float(), torch.from_numpy(keys).float())["attn_entropy_nats"]
    for h in range(3):  # rows 40..49 see 41..50 keys
        logits = q[h] @ keys[h].T / math.sqrt(8)
        want = []
        for i, pos in enumerate(range(40, 50)):
            p = np.exp(logits[i, : pos + 1] - logits[i, : pos + 1].max())
            p /= p.sum()
            want.append(-(p * np.log(p)).sum())
        assert got[h].item() == pytest.approx(np.mean(want), rel=1e-5)


def test_grouped_query_heads_see_their_key_head() -> None:
    q = torch.randn(2, 8, 5, 16)
    k = torch.randn(2, 2, 30, 16)
    got = attention_stats(q, k)
    want = attention_stats(q, k.repeat_interleave(4, dim=1))
    for name in STAT_NAMES:
        assert got[name].shape == (2, 8)
        assert torch.allclose(got[name], want[name], atol=1e-6), name


def test_never_builds_more_than_sample_by_keys(monkeypatch) -> None:
    """The biggest tensor per head is (T_q x T_k): watch every matmul result."""
    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        out = real(a, b)
        seen.append(out.shape[-2] * out.shape[-1])
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    attention_stats(torch.randn(4, 8, 16), torch.randn(4, 512, 16))
    assert max(seen) <= 8 * 512


@pytest.mark.parametrize(
    ("q", "k", "kwargs", "match"),
    [
        ((2, 4, 16), (2, 10, 8), {}, r"equal d_head"),
        ((2, 12, 16), (2, 10, 16), {}, r"more queries \(12\) than keys \(10\)"),
        ((2, 3, 16), (2, 10, 16), {"q_pos": torch.tensor([0, 5, 10])}, r"q_pos must lie in \[0, T_k=10\)"),
        ((2, 3, 16), (2, 10, 16), {"q_pos": torch.tensor([0, 5])}, r"q_pos must have shape \(3,\)"),
    ],
)
def test_bad_shapes_raise_value_error(q, k, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        attention_stats(torch.randn(q), torch.randn(k), **kwargs)


def test_qk_erank_alone_equals_the_one_attention_stats_computes_and_erank_false_skips_it():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)  # GQA: 2 key heads
    pos = torch.arange(8, 40, 2)  # 16 positions among the 40 keys
    full = attention_stats(q, k, q_pos=pos)
    torch.testing.assert_close(qk_erank(q, k), full["qk_erank"])
    cheap = attention_stats(q, k, q_pos=pos, erank=False)
    assert "qk_erank" not in cheap and cheap.keys() == full.keys() - {"qk_erank"}
    for name, value in cheap.items():
        torch.testing.assert_close(value, full[name])
    with pytest.raises(ValueError, match="qk_erank needs"):
        qk_erank(q, k[..., :4])
