"""Recipes, ``--set`` overrides, the learning-rate schedule and the data."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qkwatch.trainer.run import recipes
from qkwatch.trainer.run.config import apply_overrides
from qkwatch.trainer.run.data import ByteTokenizer, DataConfig, TrainData, binding, load_corpus, passkey
from qkwatch.trainer.run.optim import OptimConfig, lr_at


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_every_recipe_is_a_valid_config(name):
    cfg = recipes.get(name)
    assert cfg.recipe == name
    assert cfg.to_dict()["schedule"].keys() == {"lambda_0", "h_star", "beta", "ema", "lambda_max", "floor"}


def test_recipes_match_their_papers():
    debug = recipes.debug_cpu()
    assert debug.model.n_layers >= 4 and debug.train.steps == 60 and debug.train.report_every == 5
    assert debug.raa.enabled and debug.raa.par and debug.raa.rotation and debug.raa.scheduling
    grid = recipes.seed001_grid()
    m = grid.model_config()
    assert (m.d_model, m.n_heads, m.d_head, m.d_mlp, m.max_seq_len, m.bias) == (256, 4, 64, 1024, 128, True)
    o = grid.optim
    assert (o.lr, o.beta1, o.beta2, o.weight_decay, o.grad_clip, o.schedule) == (1e-4, 0.9, 0.95, 0.1, 1.0, "constant")
    assert grid.train.global_batch_size == 64 and grid.train.epochs == 45
    assert 3e6 < m.num_params() < 4e6  # seed 001: ~4M at 4 layers, 8M at 8 (with its 1758-char vocabulary)
    big = recipes.gpt_1_3b().model_config()
    assert (big.n_layers, big.n_heads, big.d_model, big.d_head) == (24, 16, 2048, 128)
    assert 1.2e9 < big.num_params() < 1.4e9 and recipes.gpt_6_7b().model_config().n_layers == 32
    assert recipes.gpt_1_3b().model_config().key_rotation == 4  # RAA's rotation is part of the architecture


def test_overrides_parse_by_type_and_apply_in_any_order():
    cfg = apply_overrides(
        recipes.debug_cpu(),
        [
            "init.qk_layers=[5]",
            "model.n_layers=6",
            "raa.enabled=false",
            "optim.lr=1e-3",
            "model.n_kv_heads=2",
            "model.d_head=none",
            "intervention.layers=1,2",
            "data.corpus=pydoc",
            "run_name=x",
        ],
    )
    assert cfg.model.n_layers == 6 and cfg.init.qk_layers == [5] and cfg.raa.enabled is False
    assert cfg.optim.lr == 1e-3 and cfg.model.n_kv_heads == 2 and cfg.model.d_head is None
    assert cfg.intervention.layers == [1, 2] and cfg.run_name == "x"
    assert cfg.model_config().key_rotation == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_layerz=3", "unknown config key 'model.n_layerz': model has"),
        ("modle.n_layers=3", "unknown config key 'modle.n_layers': the run config has"),
        ("model=3", "is a section"),
        ("seed.x=1", "seed is not a section"),
        ("model.n_layers=three", r"model\.n_layers='three': not a valid int"),
        ("raa.enabled=perhaps", "not a valid bool"),
        ("init.qk_layers=a,b", r"not a valid list\[int\]"),
        ("model.variant=fancy", r"model\.variant='fancy' is not one of"),
        ("init.qk_layers=[9]", r"init\.qk_layers has layers \[9\] beyond model\.n_layers=4"),
        ("nonsense", "expected key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(recipes.debug_cpu(), [override])


def test_learning_rate_warmup_cosine_and_constant():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 110, cfg) == pytest.approx(0.1) and lr_at(9, 110, cfg) == pytest.approx(1.0)
    assert lr_at(10, 110, cfg) == pytest.approx(1.0) and lr_at(60, 110, cfg) == pytest.approx(0.55)
    assert lr_at(110, 110, cfg) == pytest.approx(0.1)
    assert lr_at(500, 110, OptimConfig(lr=2e-4, schedule="constant")) == 2e-4


def test_byte_tokenizer_and_corpus():
    tok = ByteTokenizer()
    text = "Query–key subspaces ∠"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256
    corpus = load_corpus("pydoc")
    assert corpus.dtype == np.uint8 and len(corpus) > 400_000
    assert b"Assert statements are a convenient way" in corpus.tobytes()  # the Language Reference
    source = load_corpus("pysource").tobytes()
    assert len(source) > 1_000_000 and b"def dedent(text):" in source  # Lib/textwrap.py
    assert b"import " in source and b"Assert statements are a convenient way" not in source


def test_file_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world. " * 2000)
    data = TrainData(DataConfig(corpus=str(path)), seq_len=16, global_batch=4, seed=0)
    x, _ = data.batch(0, 0, 4)
    assert bytes(x[0].tolist()).decode() in ("hello world. " * 4)
    with pytest.raises(ValueError, match=r"data\.corpus"):
        DataConfig(corpus=str(tmp_path / "missing.txt"))


def test_batches_are_a_function_of_seed_and_step_sharded_by_rows():
    data = TrainData(DataConfig(task_mix=0.5), seq_len=64, global_batch=8, seed=1)
    x, y = data.batch(step=3, start=0, size=8)
    assert x.shape == y.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    # two ranks with micro-batches of 2 and 2 accumulation steps see the same 8 rows
    parts = [data.batch(3, start, 2)[0] for start in (0, 2, 4, 6)]
    assert torch.equal(torch.cat(parts), x)
    assert torch.equal(TrainData(DataConfig(task_mix=0.5), 64, 8, seed=1).batch(3, 0, 8)[0], x)
    assert not torch.equal(data.batch(4, 0, 8)[0], x)
    texts = [bytes(row.tolist()).decode(errors="replace") for row in x]
    assert any("What is" in t for t in texts)  # some rows are synthetic tasks
    assert data.steps_per_epoch == len(data.train) // (8 * 64)


def test_synthetic_tasks_have_the_answer_where_they_say():
    rng = random.Random(0)
    samples = passkey(rng, 300, needles=5)
    assert len(samples) == 5 and all(len(s.tokens) == 300 for s in samples)
    for s in samples:
        text = bytes(s.tokens).decode()
        ((start, end),) = s.answers
        key = text[start:end]
        assert key.isdigit() and len(key) == 5 and text.count(key) == 2  # the needle and the answer
    b = binding(rng, 120, hops=3)
    text = bytes(b.tokens).decode()
    assert len(b.tokens) == 120 and text[b.answers[0][0]].isdigit()
    with pytest.raises(ValueError, match="at least"):
        passkey(rng, 100, needles=5)
