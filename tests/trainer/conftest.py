"""Small models and run configs for the trainer's tests (everything runs on the CPU in seconds)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.gpt import GPT
from qkwatch.trainer.model.init import InitConfig, init_weights
from qkwatch.trainer.run import recipes
from qkwatch.trainer.run.config import RunConfig, TrainConfig


@pytest.fixture(autouse=True)
def _deterministic_cpu():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_model():
    """``tiny_model(**model_fields, regime=..., seed=...)`` -> an initialised GPT on the CPU."""

    def make(regime: str = "default", seed: int = 0, qk_layers=None, **fields) -> GPT:
        base = {"n_layers": 2, "n_heads": 4, "d_model": 32, "max_seq_len": 32}
        model = GPT(ModelConfig(**{**base, **fields}))
        init_weights(model, InitConfig(qk_regime=regime, qk_layers=qk_layers), seed)
        return model

    return make


@pytest.fixture
def tiny_run():
    """``tiny_run(steps, **section_overrides)`` -> the debug_cpu recipe shrunk for tests."""

    def make(steps: int = 8, **sections) -> RunConfig:
        cfg = recipes.debug_cpu()
        cfg = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, n_layers=4, d_model=32, max_seq_len=32),
            data=dataclasses.replace(cfg.data, task_mix=0.0),
            train=TrainConfig(steps=steps, global_batch_size=4, log_every=1, report_every=1, val_batches=2),
        )
        for name, changes in sections.items():
            section = getattr(cfg, name)
            cfg = dataclasses.replace(
                cfg, **{name: dataclasses.replace(section, **changes) if dataclasses.is_dataclass(section) else changes}
            )
        return cfg

    return make


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """The tests' tensors are tiny: one thread avoids OpenMP wake-ups, which dominate on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
