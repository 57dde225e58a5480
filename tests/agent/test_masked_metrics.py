"""With padded batches the agent measures only what the model attends: causal and padding masks.

The reference is the model's own attention probabilities (``output_attentions=True``, eager) and
its own queries and keys (hooks on the projections of models without RoPE), with the padding read
from the batch's ``attention_mask`` by the test itself: rows of padding queries are left out, a
row's entropy is normalised by the number of real keys it may see. Every row of every sequence is
sampled (``sample_rows = B * T``), so the agent's value must equal the reference, not approximate it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qkwatch import agent
from qkwatch.agent.metrics import qk_erank
from tests.agent.test_invisible import CASES, one_thread  # noqa: F401 (a fixture)
from tests.agent.test_probe import OFFLINE, spooled

B, T = 3, 12


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence 0 left-padded (4 pads), sequence 1 whole, sequence 2 right-padded (5 pads)."""
    x = torch.randint(1, 50, (B, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    mask[2, 7:] = 0
    return x.masked_fill(mask == 0, 0), mask


def _row_reference(probs: np.ndarray, mask: np.ndarray, causal: bool) -> dict[str, float]:
    """``probs (B, H, T, T)``: per sequence and head the mean over real query rows (entropy: those
    that see more than one real key, normalised by log of that count), the sequences averaged,
    then the heads."""
    out: dict[str, list[list[float]]] = {"attn_entropy": [], "attn_top1": [], "attn_top5": []}
    for b in range(probs.shape[0]):
        for name in out:
            out[name].append([])
        for h in range(probs.shape[1]):
            ent, top1, top5 = [], [], []
            for i in np.flatnonzero(mask[b]):
                n = int(mask[b, : i + 1].sum()) if causal else int(mask[b].sum())
                p = probs[b, h, i]
                ps = np.sort(p)[::-1]
                top1.append(ps[0])
                top5.append(ps[:5].sum())
                if n > 1:
                    ent.append(-(p[p > 0] * np.log(p[p > 0])).sum() / math.log(n))
            out["attn_entropy"][b].append(np.mean(ent))
            out["attn_top1"][b].append(np.mean(top1))
            out["attn_top5"][b].append(np.mean(top5))
    return {name: float(np.mean(np.mean(values, axis=0))) for name, values in out.items()}


def _attach(model: torch.nn.Module, tmp_path: Path, **settings) -> agent.Agent:
    a = agent.attach(
        model, spool=str(tmp_path), run="padded", every=1, sample_rows=B * T, sample_seqs=B, **{**OFFLINE, **settings}
    )
    a.step(0)
    return a


@pytest.mark.parametrize("name", ["llama-eager", "llama-sdpa", "gpt2-eager", "gpt2-sdpa", "bert-eager", "bert-sdpa"])
def test_row_statistics_of_a_padded_batch_match_the_models_own_probabilities(name: str, tmp_path: Path) -> None:
    model = CASES[name].build().eval()
    x, mask = _padded()
    a = _attach(model, tmp_path)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    causal = not name.startswith("bert")
    for layer, p in enumerate(probs):
        want = _row_reference(p.double().numpy(), mask.numpy(), causal)
        assert 0.3 < want["attn_entropy"] < 1.0  # a real value to compare, not a degenerate one
        for metric, value in want.items():
            assert report["layers"][metric][layer] == pytest.approx(value, abs=2e-6), (metric, layer)


def test_pad_tokens_change_nothing_the_agent_reports(tmp_path: Path) -> None:
    """The same real tokens with different pad tokens (and so different pad queries and keys): every
    activation metric the same, to float rounding."""
    model = CASES["bert-sdpa"].build().eval()
    x, mask = _padded()
    reports = []
    for i, filler in enumerate((0, 17)):
        a = _attach(model, tmp_path / str(i))
        with torch.no_grad():
            model(input_ids=x.masked_fill(mask == 0, filler), attention_mask=mask)
        (report,) = spooled(a)
        reports.append(report["layers"])
    for metric in ("attn_entropy", "attn_top1", "logit_std", "logit_max", "qk_erank", "attn_srank", "pr_q", "pr_k"):
        assert reports[0][metric] == pytest.approx(reports[1][metric], rel=1e-5), metric


def test_participation_ratio_erank_and_spectrum_leave_padding_out(tmp_path: Path) -> None:
    """BERT (no RoPE: q and k are its projections' outputs): ``pr_q``, ``pr_k`` over the real tokens
    of the batch, ``qk_erank`` and the spectrum over the real tokens of the first sequence."""
    model = CASES["bert-eager"].build().eval()
    x, mask = _padded()
    caught: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    handles = [
        layer.attention.self.query.register_forward_hook(lambda m, i, o: caught["q"].append(o.double()))
        for layer in model.encoder.layer
    ] + [
        layer.attention.self.key.register_forward_hook(lambda m, i, o: caught["k"].append(o.double()))
        for layer in model.encoder.layer
    ]
    a = _attach(model, tmp_path)
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    (report,) = spooled(a)
    real = mask.bool()
    first = real[0].numpy()
    for layer, (q, k) in enumerate(zip(caught["q"], caught["k"], strict=True)):
        for metric, z in (("pr_q", q), ("pr_k", k)):
            rows = z[real].numpy()  # (real tokens, width)
            ev = np.linalg.eigvalsh(np.cov(rows.T))
            assert report["layers"][metric][layer] == pytest.approx(ev.sum() ** 2 / (ev**2).sum(), rel=1e-4), metric
        qh = q[0].numpy()[first].reshape(-1, 4, 8).transpose(1, 0, 2)  # (H, real, hs)
        kh = k[0].numpy()[first].reshape(-1, 4, 8).transpose(1, 0, 2)
        sranks, gaps = [], []
        for h in range(4):
            attn = probs[layer][0, h].double().numpy()[np.ix_(first, first)]
            sv = np.linalg.svd(attn, compute_uv=False)
            sranks.append((sv**2).sum() / sv[0] ** 2)
            gaps.append(sv[0] - sv[1])
        # qk_erank in float32 as the agent computes it, on the real rows only (its float64 value
        # differs by the float32 floor on small singular values: tests/agent/metrics); with the pads
        # it would read differently
        qt, kt = torch.from_numpy(qh).float(), torch.from_numpy(kh).float()
        assert report["layers"]["qk_erank"][layer] == pytest.approx(qk_erank(qt, kt).mean().item(), rel=1e-5)
        padded = qk_erank(q[0].float().reshape(T, 4, 8).transpose(0, 1), k[0].float().reshape(T, 4, 8).transpose(0, 1))
        assert abs(padded.mean().item() - report["layers"]["qk_erank"][layer]) > 1e-2
        assert report["layers"]["attn_srank"][layer] == pytest.approx(np.mean(sranks), rel=1e-4)
        assert report["layers"]["attn_gap1"][layer] == pytest.approx(np.mean(gaps), rel=1e-4, abs=1e-6)


def test_a_decoding_step_measures_its_one_row_against_the_real_keys(tmp_path: Path) -> None:
    """Llama, eager, a left-padded prompt in the cache, then one token decoded on a report step: the
    query of the new token sees every real key before it (T_q = 1 < T_k), and nothing of the pads."""
    model = CASES["llama-eager"].build().eval()
    x, mask = _padded()
    a = agent.attach(model, spool=str(tmp_path), run="decode", every=2, sample_seqs=B, **OFFLINE)
    a.step(1)  # not a report step: the prompt fills the cache unmeasured
    with torch.no_grad():
        cache = model(input_ids=x, attention_mask=mask, use_cache=True).cache
        a.step(2)
        nxt = torch.full((B, 1), 7)
        full = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
        probs = model(input_ids=nxt, attention_mask=full, cache=cache, output_attentions=True).attentions
    (report,) = spooled(a)
    for layer, p in enumerate(probs):
        p = p.double().numpy()[:, :, 0]  # (B, H, T + 1): the one new row
        n = full.sum(1).numpy()  # real keys each new token sees
        ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1) / np.log(n)[:, None]
        assert report["layers"]["attn_entropy"][layer] == pytest.approx(ent.mean(), abs=2e-6), layer
        assert report["layers"]["attn_top1"][layer] == pytest.approx(p.max(-1).mean(), abs=2e-6), layer


@pytest.mark.parametrize("name", ["bart-eager", "bart-sdpa"])
def test_an_encoder_decoder_measures_each_stack_against_its_own_probabilities(name: str, tmp_path: Path) -> None:
    """BART: the encoder's layers are bidirectional over the real tokens of the padded batch, the
    decoder's causal over its own inputs (no decoder mask: every decoder position is a token). The
    sites are named by path (decoder first, in path order), cross-attention left out."""
    model = CASES[name].build().eval()
    x, mask = _padded()
    a = _attach(model, tmp_path)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    assert [s.name for s in a.sites] == [
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.1.self_attn",
        "model.encoder.layers.0.self_attn",
        "model.encoder.layers.1.self_attn",
    ]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=mask, output_attentions=True)
    every = torch.ones_like(mask).numpy()
    stacks = [(p, every, True) for p in out.decoder_attentions] + [
        (p, mask.numpy(), False) for p in out.encoder_attentions
    ]
    for layer, (p, real, causal) in enumerate(stacks):
        want = _row_reference(p.double().numpy(), real, causal)
        for metric, value in want.items():
            assert report["layers"][metric][layer] == pytest.approx(value, abs=2e-6), (metric, layer)
