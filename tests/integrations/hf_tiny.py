"""Tiny Hugging Face models built from configs (no download), their data, and a Trainer run that fails.

Run as a script it trains a tiny Llama with the qkwatch callback (no ``with`` block) and fails at
step 3, to show what the process hooks make of the end::

    python -m tests.integrations.hf_tiny raise|swallow URL SPOOL RUN

``raise``: the exception ends the process (``sys.excepthook``); ``swallow``: it is caught and the
process exits normally with the run still open (``atexit``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 64
N_LAYERS = 3
FAST = {"spectra_every": 0, "flush_seconds": 0.05, "backoff_base": 0.05, "backoff_cap": 0.3}
"""Agent settings that keep a test short (no spectra; quick flushes and retries)."""


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the labels their own inputs (the models shift them)."""

    def __init__(self, size: int, length: int = 16, seed: int = 0) -> None:
        self.tokens = torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_llama(layers: int = N_LAYERS, kv_heads: int = 2) -> LlamaForCausalLM:
    """Width 32, 4 query heads sharing ``kv_heads`` key/value heads (GQA), head size 8, RoPE."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(layers: int = N_LAYERS) -> GPT2LMHeadModel:
    """Width 32, 4 heads of size 8, a fused ``Conv1D`` query-key-value projection."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64))


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    """CPU, no reporting, no checkpoints; batches of 4, two micro-batches per optimizer step."""
    base: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 24,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "logging_steps": 3,
        "eval_strategy": "no",
        "save_strategy": "no",
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "seed": 0,
    }
    return TrainingArguments(**{**base, **overrides})


class Explode(TrainerCallback):
    """Raises in the optimizer step that reaches ``at`` (the way a NaN check or an OOM ends a training)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            raise RuntimeError(f"loss exploded at step {self.at}\n(a second line the reason leaves out)")


def main() -> None:
    from transformers import Trainer

    from qkwatch.integrations.huggingface import QKWatchCallback

    mode, url, spool, run = sys.argv[1:5]
    torch.set_num_threads(1)
    watch = QKWatchCallback(project="tests", run=run, url=url, every=1, spool=spool, **FAST)
    trainer = Trainer(
        model=tiny_llama(),
        args=arguments(Path(spool) / "out", max_steps=10),
        train_dataset=Tokens(64),
        callbacks=[watch, Explode(3)],
    )
    if mode == "raise":
        trainer.train()
    with contextlib.suppress(RuntimeError):  # swallowed: the process ends normally with the run still open
        trainer.train()


if __name__ == "__main__":
    main()
