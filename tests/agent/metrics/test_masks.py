"""Masked attention metrics against loops over the visible keys only, written from the definitions.

``visible_keys`` against its closed forms (each mask convention); ``attention_stats`` and
``attention_spectrum`` with a boolean mask against float64 numpy that drops the hidden keys and the
rows that see none; ``participation_ratio`` with ``rows`` against the same rows dropped.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkwatch.agent.metrics import (
    STAT_NAMES,
    attention_spectrum,
    attention_stats,
    participation_ratio,
    visible_keys,
)

RNG = np.random.default_rng(11)


def test_visible_keys_reads_every_mask_convention() -> None:
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    pad = torch.tensor([[0, 1, 1, 1]])  # left padding: the first key is a pad token
    want = causal & pad.bool()[:, None, :]  # (1, 4, 4)
    assert visible_keys(None, True, 4, 4) is None
    assert torch.equal(visible_keys(pad, True, 4, 4), want[:, None])  # (B, Tk) integer key padding
    additive = torch.where(want, 0.0, torch.finfo(torch.float32).min)[:, None]  # transformers' eager mask
    assert torch.equal(visible_keys(additive, False, 4, 4), want[:, None])
    assert torch.equal(visible_keys(additive.masked_fill(~want[:, None], -math.inf), False, 4, 4), want[:, None])
    assert torch.equal(visible_keys(want, False, 4, 4), want[:, None])  # (B, Tq, Tk) boolean
    # a static cache: the mask runs past the keys attended, and only the first T_k count
    cache = torch.zeros(1, 1, 4, 9, dtype=torch.bool)
    cache[..., :4] = want[:, None]
    assert torch.equal(visible_keys(cache, False, 4, 4), want[:, None])
    # decoding: one query sees every earlier key (bottom-right alignment), padding still hidden
    one = visible_keys(pad, True, 1, 4)
    assert one is not None and one.tolist() == [[[[False, True, True, True]]]]
    # a (B, 1, 1, T_k) broadcast mask is widened to every query
    wide = visible_keys(pad.bool()[:, None, None, :], False, 3, 4)
    assert wide is not None and wide.shape == (1, 1, 3, 4) and wide.all(-2).tolist() == [[[False, True, True, True]]]


def test_visible_keys_names_a_mask_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"3 queries and 5 keys .* got \(2, 1, 2, 5\)"):
        visible_keys(torch.ones(2, 1, 2, 5, dtype=torch.bool), False, 3, 5)


def _masked_reference(q: np.ndarray, k: np.ndarray, seen: np.ndarray) -> dict[str, float]:
    """One head: each row over the keys it sees; rows that see none left out (loops, float64)."""
    d = q.shape[-1]
    rows, logits = [], []
    for i in range(q.shape[0]):
        keys = np.flatnonzero(seen[i])
        if len(keys) == 0:
            continue
        s = np.array([q[i] @ k[j] / math.sqrt(d) for j in keys])
        logits.extend(s)
        p = np.exp(s - s.max())
        p /= p.sum()
        ps = np.sort(p)[::-1]
        nats = -sum(x * math.log(x) for x in p if x > 0)
        n = len(keys)
        rows.append(
            ((nats / math.log(n), nats) if n > 1 else None, ps[0], ps[:5].sum(), ps[0] - (ps[1] if n > 1 else 0))
        )
    ents = [r[0] for r in rows if r[0] is not None]
    la = np.array(logits)
    return {
        "attn_entropy": float(np.mean([e[0] for e in ents])),
        "attn_entropy_nats": float(np.mean([e[1] for e in ents])),
        "attn_top1": float(np.mean([r[1] for r in rows])),
        "attn_top5": float(np.mean([r[2] for r in rows])),
        "attn_gap": float(np.mean([r[3] for r in rows])),
        "logit_mean": float(la.mean()),
        "logit_std": float(la.std()),
        "logit_max": float(la.max()),
    }


@pytest.mark.parametrize("per_head", [False, True])
def test_masked_stats_count_only_visible_keys_and_skip_rows_that_see_none(per_head: bool) -> None:
    """Two sequences, 4 query heads on 2 key heads (GQA), a random mask with two empty rows."""
    b, h, g, t_q, t_k, d = 2, 4, 2, 10, 16, 8
    q = RNG.standard_normal((b, h, t_q, d)) * 2
    k = RNG.standard_normal((b, g, t_k, d))
    seen = RNG.random((b, h if per_head else 1, t_q, t_k)) < 0.6
    seen[0, :, 3] = False  # a padding query: sees no key
    seen[1, :, 7] = False
    seen[1, :, 2] = False
    seen[1, :, 2, 5] = True  # a row that sees exactly one key: no entropy, but a top-1 of 1
    got = attention_stats(torch.from_numpy(q), torch.from_numpy(k), mask=torch.from_numpy(seen), erank=False)
    for s in range(b):
        for head in range(h):
            want = _masked_reference(q[s, head], k[s, head // (h // g)], seen[s, head if per_head else 0])
            for name in STAT_NAMES:
                if name != "qk_erank":
                    assert got[name][s, head].item() == pytest.approx(want[name], rel=1e-9, abs=1e-12), (name, s, head)


def test_a_mask_equal_to_the_causal_one_gives_the_causal_values() -> None:
    q, k = (torch.from_numpy(RNG.standard_normal((3, 6, 8))) for _ in range(2))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    by_mask = attention_stats(q, k, mask=causal, erank=False)
    by_flag = attention_stats(q, k, causal=True, erank=False)
    for name, value in by_flag.items():
        torch.testing.assert_close(by_mask[name], value, rtol=1e-12, atol=1e-12)


def test_a_row_set_with_nothing_to_average_is_nan() -> None:
    q, k = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 3, 4, dtype=torch.float64)
    none = torch.zeros(1, 3, 3, dtype=torch.bool)
    assert all(math.isnan(v.item()) for v in attention_stats(q, k, mask=none, erank=False).values())


def test_masked_spectrum_is_that_of_the_rows_and_keys_left() -> None:
    """Padding rows and keys removed by hand: the spectrum of what is left, in numpy (float64)."""
    t, d, pads = 9, 6, [0, 1, 6]
    q = RNG.standard_normal((2, t, d)) * 2
    k = RNG.standard_normal((2, t, d))
    real = np.setdiff1d(np.arange(t), pads)
    seen = np.tril(np.ones((t, t), dtype=bool))
    seen[:, pads] = False
    seen[pads] = False
    for remove_outlier in (False, True):
        got = attention_spectrum(
            torch.from_numpy(q), torch.from_numpy(k), remove_outlier=remove_outlier, mask=torch.from_numpy(seen)[None]
        )
        for head in range(2):
            qs, ks = q[head][real], k[head][real]
            logits = qs @ ks.T / math.sqrt(d)
            causal = np.tril(np.ones((len(real), len(real)), dtype=bool))
            p = np.exp(np.where(causal, logits, -np.inf) - logits.max(1, keepdims=True))
            a = p / p.sum(1, keepdims=True)
            if remove_outlier:
                a = a - causal / causal.sum(1, keepdims=True)
            sv = np.linalg.svd(a, compute_uv=False)
            assert got["attn_srank"][head].item() == pytest.approx((sv**2).sum() / sv[0] ** 2, rel=1e-9)
            assert got["attn_gap1"][head].item() == pytest.approx(sv[0] - sv[1], rel=1e-9, abs=1e-12)


def test_participation_ratio_of_some_rows_is_that_of_those_rows() -> None:
    x = torch.from_numpy(RNG.standard_normal((3, 40, 12)))
    rows = torch.from_numpy(RNG.random((3, 40)) < 0.7)
    got = participation_ratio(x, rows)
    for i in range(3):
        torch.testing.assert_close(got[i], participation_ratio(x[i][rows[i]]), rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match=r"rows must have shape \(3, 40\)"):
        participation_ratio(x, rows[0])
