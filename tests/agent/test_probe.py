"""What the agent measures in-process: sampled attention against full eager attention, adapters,
the missing-layer check, torch.compile, forked workers. Offline agents: reports are read back
from their spool."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkwatch import agent
from qkwatch.agent.models.adapters import AdapterError, find_sites
from qkwatch.agent.offline.analyze import analyze
from qkwatch.agent.probe.probe import ProbeConfig
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.tiny import TinyGPT, batch, train

OFFLINE = {"spectra_every": 0, "flush_seconds": 0.05}


def spooled(a) -> list[dict]:
    a.close(timeout=0.2)
    spool = Spool(a.spool_path)
    try:
        return [r.payload["report"] for r in spool.pending(10_000) if "report" in r.payload]  # not the end status
    finally:
        spool.close()


def llama(n_layers: int = 3, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=n_layers,
        intermediate_size=96,
        vocab_size=97,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


def test_sampled_entropy_against_full_eager_attention(tmp_path: Path) -> None:
    """Rows sampled from the RoPE'd, GQA queries the model really uses.

    ``sample_rows=32`` over the batch's 2 sequences: 16 evenly spaced rows of each. Exact at the
    sampled rows (1e-4); against the mean over every row of both sequences within 0.02 (the stated
    tolerance of the sample).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = llama()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    x = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(1))
    a = agent.attach(model, spool=str(tmp_path), run="eager", every=1, sample_rows=32, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(x)
    assert model.config._attn_implementation == "sdpa"  # the config untouched
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__ is sdpa  # the model's own sdpa, wrapped while attached
    (report,) = spooled(a)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa  # put back on close
    with torch.no_grad():
        probs = model(x, output_attentions=True, attn_implementation="eager").attentions
    pos = torch.linspace(0, 127, 16).round().long().unique()
    n = torch.arange(1, 129, dtype=torch.float64)
    for layer, p in enumerate(probs):
        p = p.double()  # both sequences: (2, heads, T, T)
        ent = torch.special.entr(p).sum(-1)[..., 1:] / n[1:].log()  # rows that see more than one key
        full = ent.mean().item()
        at_rows = ent[..., pos[pos > 0] - 1].mean().item()
        sampled = report["layers"]["attn_entropy"][layer]
        assert sampled == pytest.approx(at_rows, abs=1e-4)
        assert sampled == pytest.approx(full, abs=0.02)
        top1 = p[..., pos, :].max(-1).values.mean().item()
        assert report["layers"]["attn_top1"][layer] == pytest.approx(top1, abs=1e-4)


def test_weight_metrics_match_the_checkpoint_view(tmp_path: Path) -> None:
    """The agent's live QKAI per layer equals `qkwatch analyze` on the same model saved to disk."""
    model = llama()
    model.save_pretrained(tmp_path / "model")
    a = agent.attach(model, spool=str(tmp_path / "s"), run="w", every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 16)))
    (report,) = spooled(a)
    offline = analyze(tmp_path / "model", spectra=False)
    for layer in range(3):
        for name in ("qkai", "qkai_max", "stable_rank", "qk_cos"):
            assert report["layers"][name][layer] == pytest.approx(offline.layers[layer][name], rel=1e-5)


def weight_reference(wq: np.ndarray, wk: np.ndarray, n_heads: int) -> dict[str, float]:
    """A layer's qkai, stable_rank and qk_cos from float64 numpy: ``nn.Linear`` layout in
    (``(n_heads * d_head, d_model)``, rows of head h together), SVDs of each head."""
    d_head = wq.shape[0] // n_heads
    qkai, srank = [], []
    for h in range(n_heads):
        q, k = wq[h * d_head : (h + 1) * d_head].T, wk[h * d_head : (h + 1) * d_head].T  # (d_model, d_head)
        uq, uk = np.linalg.svd(q, full_matrices=False)[0], np.linalg.svd(k, full_matrices=False)[0]
        qkai.append(np.mean(np.linalg.svd(uq.T @ uk, compute_uv=False) ** 2))
        s = np.linalg.svd(q @ k.T, compute_uv=False)
        srank.append((s**2).sum() / s[0] ** 2)
    cos = np.abs((wq * wk).sum(1)) / (np.linalg.norm(wq, axis=1) * np.linalg.norm(wk, axis=1))
    return {"qkai": float(np.mean(qkai)), "stable_rank": float(np.mean(srank)), "qk_cos": float(cos.mean())}


def entropy_reference(p: np.ndarray, causal: bool) -> float:
    """Mean normalised entropy of attention probabilities ``p (B, H, T, T)`` over every row that sees
    more than one key (causal: row i sees i + 1 keys, normalised by log(i + 1); otherwise log T)."""
    t = p.shape[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)  # (B, H, T)
    if not causal:
        return float((h / np.log(t)).mean())
    return float((h[..., 1:] / np.log(np.arange(2, t + 1))).mean())


def causal_probs(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d_head)) with the causal mask; q, k ``(B, H, T, d_head)``."""
    t = q.shape[-2]
    logits = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    logits = np.where(np.tril(np.ones((t, t), dtype=bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _adapter_model(kind: str):
    """The model, its per-layer (W_Q, W_K) in ``nn.Linear`` layout read here from each layout, its heads.

    Queries and keys are scaled up so that attention is sharp (at initialisation it is nearly
    uniform, where every entropy reads about 1 whatever is measured).
    """
    if kind == "nanogpt":
        model = TinyGPT()
        d = model.h[0].attn.c_attn.in_features
        with torch.no_grad():
            for block in model.h:
                block.attn.c_attn.weight[: 2 * d].mul_(3.0)
        weights = [(b.attn.c_attn.weight[:d], b.attn.c_attn.weight[d : 2 * d]) for b in model.h]  # rows [q; k; v]
        return model, weights, model.h[0].attn.n_head
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    if kind == "gpt2":
        config = GPT2Config(
            n_embd=32, n_head=4, n_layer=3, vocab_size=50, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        model = GPT2LMHeadModel(config).eval()  # eval: no dropout between the two forwards
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.weight[:, :64].mul_(12.0)
        # Conv1D: (d_model, 3 d_model), columns [q | k | v]
        weights = [(b.attn.c_attn.weight[:, :32].T, b.attn.c_attn.weight[:, 32:64].T) for b in model.transformer.h]
        return model, weights, 4
    config = BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=3, intermediate_size=64, vocab_size=50)
    model = BertModel(config).eval()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(12.0)
            layer.attention.self.key.weight.mul_(12.0)
    weights = [(x.attention.self.query.weight, x.attention.self.key.weight) for x in model.encoder.layer]
    return model, weights, 4


@pytest.mark.parametrize("kind", ["gpt2", "bert", "nanogpt"])
def test_adapters_find_every_layer(kind: str, tmp_path: Path) -> None:
    """Each adapter reads the right W_Q and W_K (Conv1D's transposed fused layout, BERT's separate
    projections, nanoGPT's fused Linear) and taps the queries and keys the model attends with: the
    report against numpy on the weights and on attention computed outside the agent (the model's
    own eager attention for the HF models, softmax of ``c_attn``'s output for nanoGPT)."""
    model, weights, n_heads = _adapter_model(kind)
    n_layers = len(weights)
    x = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(3))
    a = agent.attach(model, spool=str(tmp_path), run=kind, every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(x)
    (report,) = spooled(a)
    assert "events" not in report  # no missing layers
    assert a.sites[0].causal is (kind != "bert")  # BERT is not causal: every row sees every key
    for name in ("qkai", "stable_rank", "attn_entropy", "pr_q", "qk_erank"):
        values = report["layers"][name]
        assert len(values) == n_layers and all(isinstance(v, float) and math.isfinite(v) for v in values), name
    with torch.no_grad():
        if kind == "nanogpt":
            outputs = []
            handles = [b.attn.c_attn.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in model.h]
            model(x)
            for handle in handles:
                handle.remove()
            d = 32
            probs = []
            for out in outputs:  # (B, T, 3 d): [q | k | v], heads side by side
                q, k = (out[..., i * d : (i + 1) * d].double().numpy() for i in (0, 1))
                q, k = (z.reshape(2, 24, n_heads, -1).transpose(0, 2, 1, 3) for z in (q, k))  # (B, H, T, hs)
                probs.append(causal_probs(q, k))
        else:
            model.set_attn_implementation("eager")
            probs = [p.double().numpy() for p in model(x, output_attentions=True).attentions]
    entropies = [entropy_reference(p, causal=kind != "bert") for p in probs]
    assert min(entropies) > 0.2 and max(entropies) < 0.9  # sharp enough to tell rows and keys apart
    for layer, (wq, wk) in enumerate(weights):
        want = weight_reference(wq.detach().double().numpy(), wk.detach().double().numpy(), n_heads)
        for name in ("qkai", "stable_rank", "qk_cos"):
            assert report["layers"][name][layer] == pytest.approx(want[name], rel=1e-4, abs=1e-6), (name, layer)
        assert report["layers"]["attn_entropy"][layer] == pytest.approx(entropies[layer], abs=1e-4), layer


def test_explicit_layout(tmp_path: Path) -> None:
    """A model no adapter knows, named by a Layout (separate q and k projections, 2 heads, causal
    by default): the report against numpy on its weights and on its projections' outputs, and the
    same layout read off the model's state dict on disk gives the same weight metrics."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.wq(x) + self.wk(x)

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(Attn() for _ in range(2))})
    with torch.no_grad():
        for layer in model["layers"]:  # sharp attention (see _adapter_model)
            layer.wq.weight.mul_(4.0)
            layer.wk.weight.mul_(4.0)
    layout = agent.Layout(q="layers.{i}.wq", k="layers.{i}.wk", n_heads=2)
    sites = find_sites(model, layout)
    assert [s.layer for s in sites] == [0, 1] and sites[0].d_head == 8
    a = agent.attach(model, spool=str(tmp_path), run="m", every=1, layout=layout, **OFFLINE)
    a.step(0)
    inputs = [torch.randn(1, 10, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for layer, x in zip(model["layers"], inputs, strict=True):
        layer(x)
    (report,) = spooled(a)
    for i, (layer, x) in enumerate(zip(model["layers"], inputs, strict=True)):
        wq, wk = (m.weight.detach().double().numpy() for m in (layer.wq, layer.wk))
        want = weight_reference(wq, wk, 2)
        for name in ("qkai", "stable_rank", "qk_cos"):
            assert report["layers"][name][i] == pytest.approx(want[name], rel=1e-4, abs=1e-6), (name, i)
        xs = x.double().numpy()[0]  # (T, d_model)
        q = (xs @ wq.T + layer.wq.bias.detach().double().numpy()).reshape(1, 10, 2, 8).transpose(0, 2, 1, 3)
        k = (xs @ wk.T + layer.wk.bias.detach().double().numpy()).reshape(1, 10, 2, 8).transpose(0, 2, 1, 3)
        entropy = entropy_reference(causal_probs(q, k), causal=True)
        assert 0.2 < entropy < 0.9
        assert report["layers"]["attn_entropy"][i] == pytest.approx(entropy, abs=1e-4), i
    torch.save(model.state_dict(), tmp_path / "model.pt")
    offline = analyze(tmp_path / "model.pt", layout=layout, spectra=False)
    assert offline.shape.n_layers == 2 and offline.shape.n_heads == 2
    for i in range(2):
        assert report["layers"]["qkai"][i] == pytest.approx(offline.layers[i]["qkai"], rel=1e-5)


def test_a_layout_names_every_pattern_with_the_layer_index() -> None:
    """``agent.Mapping``, the older name, is the same type; a path without ``{i}`` is refused, not looped on."""
    assert agent.Mapping is agent.Layout
    model = torch.nn.ModuleDict({"wq": torch.nn.Linear(4, 4), "wk": torch.nn.Linear(4, 4)})
    with pytest.raises(AdapterError, match=r"^put \{i\} where the layer index goes in the Layout.s path .wq.$"):
        find_sites(model, agent.Layout(q="wq", k="wk", n_heads=2))
    with pytest.raises(AdapterError, match=r"^add n_heads= .* qkwatch found none on the model$"):
        find_sites(model, agent.Layout(q="{i}.wq", k="{i}.wk"))


def test_missing_layers_are_reported_on_the_first_report(tmp_path: Path) -> None:
    model = TinyGPT()
    attn = model.h[2].attn

    def fast_path(x):  # bypasses the c_attn module: its hook never sees this layer
        b, t, c = x.shape
        q, k, v = F.linear(x, attn.c_attn.weight, attn.c_attn.bias).split(c, dim=2)
        q, k, v = (z.view(b, t, attn.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.c_proj(y.transpose(1, 2).reshape(b, t, c))

    attn.forward = fast_path
    a = agent.attach(model, spool=str(tmp_path), run="fast", every=1, **OFFLINE)
    train(a, model, 2)
    first, second = spooled(a)[:2]
    (event,) = first["events"]
    assert event["kind"] == "missing_layers" and event["data"]["layers"] == [2]
    assert first["layers"]["attn_entropy"][2] is None and isinstance(first["layers"]["attn_entropy"][1], float)
    assert "events" not in second  # said once


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_no_recompiles_after_warm_up(tmp_path: Path, backend: str) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="compiled", every=2, **OFFLINE)
    compiled = torch.compile(model, backend=backend)  # dynamo decides recompiles; inductor runs the op
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = []
    for step in range(12):
        a.step(step)
        x = batch(step)
        loss = F.cross_entropy(compiled(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[3] == graphs[-1]  # report and non-report steps both warm after the first cycle
    assert sum(counters["graph_break"].values()) == 0  # the hooks trace as no-ops
    reports = spooled(a)
    assert [r["step"] for r in reports] == [0, 2, 4, 6, 8, 10]
    for report in reports:
        assert all(isinstance(v, float) for v in report["layers"]["qkai"])  # weights read outside the graph
        assert all(isinstance(v, float) for v in report["layers"]["attn_entropy"])  # through qkwatch::tap
    assert "events" not in reports[0]  # nothing missing
    twin = TinyGPT()  # the same weights and batch, uncompiled: the same values
    twin.load_state_dict(model.state_dict())
    b = agent.attach(twin, spool=str(tmp_path / "eager"), run="eager", every=2, **OFFLINE)
    b.step(12)
    a2 = agent.attach(model, spool=str(tmp_path / "again"), run="again", every=2, **OFFLINE)
    a2.step(12)
    with torch.no_grad():
        twin(batch(12)[:, :-1])
        compiled(batch(12)[:, :-1])
    (eager_report,) = spooled(b)
    (compiled_report,) = spooled(a2)
    for name in ("attn_entropy", "attn_top1", "qkai", "pr_q"):
        assert compiled_report["layers"][name] == pytest.approx(eager_report["layers"][name], rel=1e-5), name


def test_forked_workers_leave_the_agent_inert(tmp_path: Path) -> None:
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="forked", every=1, **OFFLINE)
    train(a, model, 2)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker would be such a child
        try:
            a.step(2)
            a.log(2, loss=1.0)
            a.close(timeout=0.1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    train(a, model, 4, start=2)
    steps = [r["step"] for r in spooled(a)]
    assert steps == [0, 1, 2, 3]  # the child wrote nothing, and the parent goes on


def test_dataloader_workers(tmp_path: Path) -> None:
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="loader", every=1, **OFFLINE)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            a.log(100 + i, loss=float(i))  # a worker touching the agent does nothing
            return batch(i)[0]

    loader = torch.utils.data.DataLoader(Data(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    for step, x in enumerate(loader):
        a.step(step)
        model(x[:, :-1])
    reports = spooled(a)
    assert [r["step"] for r in reports] == [0, 1]
    assert all("loss" not in r["scalars"] for r in reports)


def qk_of(model) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], list]:
    """The (q, k) each qkwatch GPT layer attends with, seen through its own hook on ``qk_tap``."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [
        block.attn.qk_tap.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args))
        for i, block in enumerate(model.blocks)
    ]
    return seen, handles


def numpy_spectrum(q, k, remove_outlier: bool) -> tuple[float, float]:
    """Mean over heads of seed 003's stable rank and gap of the causal A (or A - U), float64 numpy."""
    q, k = q.double().numpy(), k.double().numpy()  # (H, W, hs)
    w = q.shape[-2]
    causal = np.tril(np.ones((w, w), dtype=bool))
    sranks, gaps = [], []
    for h in range(q.shape[0]):
        s = np.where(causal, q[h] @ k[h].T / math.sqrt(q.shape[-1]), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        if remove_outlier:
            a = a - causal / np.arange(1, w + 1)[:, None]
        sv = np.linalg.svd(a, compute_uv=False)
        sranks.append((sv**2).sum() / sv[0] ** 2)
        gaps.append(sv[0] - sv[1])
    return float(np.mean(sranks)), float(np.mean(gaps))


def test_outlier_removed_gpt_reports_the_spectrum_of_a_minus_u(tmp_path: Path) -> None:
    """Seed 003's variant attends with A - U: the probe measures that matrix, on the first
    ``spectrum_window`` tokens of the first sequence."""
    from qkwatch.trainer.model.config import ModelConfig
    from qkwatch.trainer.model.gpt import GPT

    small = {"n_layers": 2, "n_heads": 2, "d_model": 32, "max_seq_len": 48, "vocab_size": 64}
    assert not any(site.remove_outlier for site in find_sites(GPT(ModelConfig(**small))))
    torch.manual_seed(0)
    model = GPT(ModelConfig(variant="outlier_removed", **small)).eval()
    assert all(site.remove_outlier for site in find_sites(model))
    seen, handles = qk_of(model)
    a = agent.attach(model, spool=str(tmp_path), run="outlier", every=1, spectrum_window=32, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1)))
    (report,) = spooled(a)
    for handle in handles:
        handle.remove()
    for layer, (q, k) in seen.items():
        srank, gap = numpy_spectrum(q[0, :, :32], k[0, :, :32], remove_outlier=True)
        assert report["layers"]["attn_srank"][layer] == pytest.approx(srank, rel=1e-4)
        assert report["layers"]["attn_gap1"][layer] == pytest.approx(gap, rel=1e-4, abs=1e-6)
        plain_srank, _ = numpy_spectrum(q[0, :, :32], k[0, :, :32], remove_outlier=False)
        assert abs(plain_srank - srank) > 0.1 * plain_srank  # A's value would be a different number


def test_participation_ratio_reads_rows_of_the_whole_micro_batch(tmp_path: Path) -> None:
    """pr_q and pr_k come from every position of the micro-batch (8 x 64 = 512 rows), or ``pr_rows``
    of them evenly strided; from 64 rows of one sequence PR could not exceed 63."""
    from qkwatch.trainer.model.config import ModelConfig
    from qkwatch.trainer.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, d_model=128, max_seq_len=64)).eval()
    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    seen, handles = qk_of(model)
    full = agent.attach(model, spool=str(tmp_path / "a"), run="all", every=1, sample_rows=64, **OFFLINE)
    full.step(0)
    with torch.no_grad():
        model(x)
    (report,) = spooled(full)
    strided = agent.attach(model, spool=str(tmp_path / "b"), run="strided", every=1, pr_rows=100, **OFFLINE)
    strided.step(0)
    with torch.no_grad():
        model(x)
    (report_strided,) = spooled(strided)
    for handle in handles:
        handle.remove()

    def numpy_pr(rows: np.ndarray) -> float:
        eig = np.linalg.eigvalsh(np.cov(rows.T))
        return float(eig.sum() ** 2 / (eig**2).sum())

    picked = np.round(np.linspace(0, 511, 100)).astype(int)
    for layer, (q, k) in seen.items():
        q_rows = q.transpose(1, 2).reshape(512, 128).double().numpy()  # (B*T, H*hs): heads side by side
        k_rows = k.transpose(1, 2).reshape(512, 64).double().numpy()  # (B*T, G*hs)
        pr_q = report["layers"]["pr_q"][layer]
        assert pr_q == pytest.approx(numpy_pr(q_rows), rel=1e-4)
        assert report["layers"]["pr_k"][layer] == pytest.approx(numpy_pr(k_rows), rel=1e-4)
        assert report_strided["layers"]["pr_q"][layer] == pytest.approx(numpy_pr(q_rows[picked]), rel=1e-4)
        one_sequence = numpy_pr(q_rows[np.round(np.linspace(0, 63, 64)).astype(int)])  # the old path
        assert one_sequence <= 63 and pr_q > 1.3 * one_sequence, (pr_q, one_sequence)


@pytest.mark.parametrize(
    ("setting", "match"),
    [({"pr_rows": 1}, r"pr_rows must be an integer >= 2"), ({"spectrum_window": 0}, r"spectrum_window must be")],
)
def test_spectrum_and_pr_settings_are_validated(setting: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProbeConfig(**setting)
    with pytest.raises(ValueError, match=match):  # the flat keywords of agent.attach reach the same check
        agent.AgentConfig.resolve(**setting)
    defaults = agent.AgentConfig().probe
    assert (defaults.pr_rows, defaults.spectrum_window) == (4096, 256)


def test_row_statistics_average_sample_seqs_sequences_and_qk_erank_reads_the_first(tmp_path: Path) -> None:
    """``sample_rows`` rows spread over the first ``sample_seqs`` sequences (16 of each of 4), the
    entropy averaged over them, against float64 numpy; ``qk_erank`` from 64 rows of sequence 0."""
    from qkwatch.trainer.model.config import ModelConfig
    from qkwatch.trainer.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, n_heads=4, d_model=64, max_seq_len=64)).eval()
    with torch.no_grad():
        for block in model.blocks:  # large logits: sharp attention that differs from sequence to sequence
            block.attn.q_proj.weight.mul_(6.0)
            block.attn.k_proj.weight.mul_(6.0)
    x = torch.randint(0, 256, (6, 64), generator=torch.Generator().manual_seed(2))
    seen, handles = qk_of(model)
    a = agent.attach(model, spool=str(tmp_path), run="seqs", every=1, sample_rows=64, sample_seqs=4, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(x)
    (report,) = spooled(a)
    for handle in handles:
        handle.remove()
    pos = np.unique(np.round(np.linspace(0, 63, 16)).astype(int))
    rows = np.unique(np.round(np.linspace(0, 63, 64)).astype(int))
    for layer, (q, k) in seen.items():
        q, k = q.double().numpy(), k.double().numpy()  # (6, H, 64, hs)
        logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])  # (6, H, 64, 64)
        logits = np.where(np.tril(np.ones((64, 64), dtype=bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)  # (6, H, 64)
        picked = pos[pos > 0]  # rows that see more than one key
        per_seq = (h[:, :, picked] / np.log(picked + 1)).mean((1, 2))  # (6,)
        assert report["layers"]["attn_entropy"][layer] == pytest.approx(per_seq[:4].mean(), abs=1e-5)
        assert abs(per_seq[:4].mean() - per_seq[0]) > 1e-3  # the sequences differ: the average is not sequence 0
        s = np.linalg.svd(q[0][:, rows] @ k[0].transpose(0, 2, 1), compute_uv=False)  # (H, min)
        prob = s / s.sum(-1, keepdims=True)
        erank = np.exp(-(prob * np.log(np.where(prob > 0, prob, 1))).sum(-1)).mean()
        assert report["layers"]["qk_erank"][layer] == pytest.approx(erank, rel=1e-3)


def test_the_measure_thread_reports_what_the_hook_computes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU activation metrics computed in the ``qkwatch-measure`` thread from copies of the sampled
    rows, every layer in one batch, equal those computed in the hook itself layer by layer, per
    layer and per head, report after report (the model trains between them, so a copy that
    aliased the model's buffers would differ)."""
    from qkwatch.agent.probe.probe import Probe

    batches: list[int] = []
    batch_of = Probe._activation_batch

    def counted(self, queued):
        batches.append(len(queued))
        return batch_of(self, queued)

    monkeypatch.setattr(Probe, "_activation_batch", counted)
    reports = {}
    for threaded in (True, False):
        torch.manual_seed(0)
        model = TinyGPT()
        a = agent.attach(
            model, spool=str(tmp_path / str(threaded)), run="r", every=2, heads=True, measure_thread=threaded, **OFFLINE
        )
        train(a, model, 5)
        reports[threaded] = [r for r in spooled(a) if r["layers"]]
    assert [r["step"] for r in reports[True]] == [0, 2, 4]
    assert batches == [4, 4, 4]  # TinyGPT's 4 layers, once per report
    for threaded, inline in zip(reports[True], reports[False], strict=True):
        assert set(threaded["layers"]) >= {"attn_entropy", "attn_srank", "qk_erank", "pr_q"}
        assert threaded["layers"] == inline["layers"]
        assert threaded["heads"] == inline["heads"]


def test_a_failure_in_the_measure_thread_is_a_missing_layer_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception in the worker thread skips that layer's activation metrics with one warning; the
    first report names the layers as missing; training and the weight metrics carry on."""
    from qkwatch.agent.probe import activations

    def broken(*args, **kwargs):
        raise RuntimeError("spectrum exploded")

    monkeypatch.setattr(activations, "attention_spectrum", broken)
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="r", every=1, **OFFLINE)
    train(a, model, 2)
    reports = [r for r in spooled(a) if r["layers"]]
    assert [r["step"] for r in reports] == [0, 1]
    assert all(v is None for v in reports[0]["layers"].get("attn_entropy", [None]))
    assert all(isinstance(v, float) for v in reports[0]["layers"]["qkai"])
    assert [e["kind"] for e in reports[0]["events"]] == ["missing_layers"]
    warnings = [r.message for r in caplog.records if "spectrum exploded" in r.message]
    assert len(warnings) == 1


def test_taps_cut_q_and_k_out_only_on_report_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tap on a fused projection (nanoGPT's ``c_attn``) splits, views and transposes q and k only
    when the probe wants them: a report armed and the layer not measured yet. Off report steps a
    forward makes exactly the ``transpose`` calls of the model without the agent; the reports still
    measure every layer."""
    kind = "nanogpt"
    model, weights, _ = _adapter_model(kind)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    transposes: list[int] = []
    real = torch.Tensor.transpose

    def counted(self, *args):
        transposes.append(1)
        return real(self, *args)

    def forward_transposes() -> int:
        transposes.clear()
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(torch.Tensor, "transpose", counted)
            model(x)
        return len(transposes)

    bare = forward_transposes()
    a = agent.attach(model, spool=str(tmp_path), run=kind, every=3, **OFFLINE)
    per_step = []
    for step in range(6):
        a.step(step)
        per_step.append(forward_transposes())
    reports = [r for r in spooled(a) if r["layers"]]
    assert [r["step"] for r in reports] == [0, 3]
    assert all(len(r["layers"]["attn_entropy"]) == len(weights) for r in reports)
    assert [per_step[i] for i in (1, 2, 4, 5)] == [bare] * 4  # off report steps: the model's own only
    assert per_step[0] >= bare + 2 * len(weights) and per_step[3] >= bare + 2 * len(weights)  # q and k of each layer


def test_weights_no_update_touched_are_not_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report reads the weights as they are when its step is armed (its ``step()`` call, before its
    forward). Layers whose weights no in-place update touched since the last report keep their values
    without a new weight pass; an update to one layer remeasures that layer alone; every value equals
    numpy's."""
    from qkwatch.agent.metrics.summary import weight_metrics
    from qkwatch.agent.probe import weights as probe_weights

    layers_measured: list[int] = []

    def counted(wq, wk, rotation=None, **kw):
        layers_measured.append(wq.shape[0])
        return weight_metrics(wq, wk, rotation, **kw)

    monkeypatch.setattr(probe_weights, "weight_metrics", counted)
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="w", every=1, **OFFLINE)
    d, n_head = model.h[0].attn.c_attn.in_features, model.h[0].attn.n_head
    expected = []

    def reference() -> list[float]:
        w = [b.attn.c_attn.weight.detach().numpy().astype(np.float64) for b in model.h]
        return [weight_reference(x[:d], x[d : 2 * d], n_head)["qkai"] for x in w]

    for step in range(5):
        a.step(step)  # reads the weights of step's report as they are now, before its forward
        expected.append(reference())
        with torch.no_grad():
            model(batch(step)[:, :-1])
            if step == 0:  # an optimizer-like in-place update of every layer
                for block in model.h:
                    block.attn.c_attn.weight.mul_(1.5).add_(0.01)
            if step == 2:  # one layer only
                model.h[2].attn.c_attn.weight[:d].add_(0.05 * torch.randn(d, d))
            if step == 3:  # through .data, which bumps no version counter (old optimizers, EMA code)
                model.h[1].attn.c_attn.weight.data[d : 2 * d].add_(0.05 * torch.randn(d, d))
    reports = [r for r in spooled(a) if r["layers"]]
    assert [r["step"] for r in reports] == [0, 1, 2, 3, 4]
    # report 0: all 4 layers (initial); 1: all (updated at step 0); 2: none touched; 3: layer 2; 4: layer 1
    assert layers_measured == [4, 4, 1, 1]
    for report, want in zip(reports, expected, strict=True):
        np.testing.assert_allclose(report["layers"]["qkai"], want, rtol=1e-4)
    assert reports[2]["layers"]["qkai"] == reports[1]["layers"]["qkai"]  # nothing touched between them
    assert reports[3]["layers"]["qkai"][2] != reports[2]["layers"]["qkai"][2]
    assert reports[3]["layers"]["qkai"][:2] == reports[2]["layers"]["qkai"][:2]
    assert reports[4]["layers"]["qkai"][1] != reports[3]["layers"]["qkai"][1]
