"""The run's config the callback sends: the useful ``TrainingArguments`` and the model config's shape."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import transformers
from torch import nn
from transformers import TrainingArguments

TRAINING_FIELDS = (
    "output_dir",
    "run_name",
    "seed",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "max_grad_norm",
    "optim",
    "bf16",
    "fp16",
    "torch_compile",
    "gradient_checkpointing",
    "logging_steps",
    "eval_strategy",
    "eval_steps",
)
"""The ``TrainingArguments`` a run's config keeps (under ``training``), where the installed version has them."""
MODEL_FIELDS = (
    "model_type",
    "_name_or_path",
    "architectures",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "hidden_size",
    "n_embd",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "n_positions",
    "rope_theta",
    "dtype",
    "torch_dtype",
)
"""The model config's fields a run's config keeps (under ``model``)."""


def run_config(args: TrainingArguments, model: nn.Module, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's config: ``config`` over ``framework``, ``training`` (``TRAINING_FIELDS``, world size) and ``model``."""
    training = _json_fields(args.to_dict(), TRAINING_FIELDS)  # type: ignore[no-untyped-call]  # unannotated upstream
    training["world_size"] = args.world_size
    out: dict[str, Any] = {"framework": f"transformers {transformers.__version__}", "training": training}
    model_config = getattr(model, "config", None)
    if model_config is not None and callable(getattr(model_config, "to_dict", None)):
        out["model"] = _json_fields(model_config.to_dict(), MODEL_FIELDS)
    return {**out, **(config or {})}


def _json_fields(values: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The ``keys`` of ``values`` whose value strict JSON can carry (no NaN or inf, no objects)."""
    return {k: values[k] for k in keys if k in values and _plain(values[k])}


def _plain(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))
