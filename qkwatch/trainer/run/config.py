"""The configuration of one training run, and ``--set key=value`` overrides into it.

A run's config is a :class:`RunConfig` of component configs, each a dataclass next to its owner
(``model.config.ModelConfig``, ``model.rank_anchored.RAAConfig``, ...). Recipes
(``trainer.run.recipes``) are functions that return one; ``--set model.n_layers=6 --set
raa.enabled=false`` changes fields by dotted key, parsed by the field's type, and every changed
section is validated again by its ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qkwatch.trainer.checkpoints.checkpoint import CheckpointConfig
from qkwatch.trainer.model.config import ModelConfig
from qkwatch.trainer.model.init import InitConfig
from qkwatch.trainer.model.rank_anchored import RAAConfig
from qkwatch.trainer.run.data import DataConfig
from qkwatch.trainer.run.interventions import InterventionConfig
from qkwatch.trainer.run.optim import OptimConfig
from qkwatch.trainer.run.parallelize import ParallelConfig

T = TypeVar("T")


@dataclass
class TrainConfig:
    """Length, batch and cadences of the training loop."""

    steps: int = 100
    """Optimizer steps (ignored when epochs is set)."""
    epochs: float | None = None
    """Train for this many passes over the corpus instead of a fixed number of steps."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all ranks and micro-batches."""
    micro_batch_size: int | None = None
    """Sequences per rank per forward; None = global_batch_size / world (no accumulation)."""
    seq_len: int | None = None
    """Training sequence length; None = model.max_seq_len."""
    log_every: int = 10
    """Steps between terminal / metrics.jsonl lines (one device sync each)."""
    report_every: int = 50
    """The monitor's report cadence (the agent's QKWATCH_EVERY)."""
    val_every: int = 0
    """Steps between validation losses (0: only at the end)."""
    val_batches: int = 8
    """Validation windows per evaluation (of seq_len tokens)."""
    qkai_every: int = 0
    """Steps between per-layer QKAI lines in the log and metrics.jsonl (0: never; the agent reports it too)."""

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch_size", "log_every", "report_every", "val_batches"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"train.epochs must be > 0 or None, got {self.epochs}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"train.micro_batch_size must be >= 1 or None, got {self.micro_batch_size}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"train.seq_len must be >= 2 or None, got {self.seq_len}")
        for key in ("val_every", "qkai_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0, got {getattr(self, key)}")

    def accumulation(self, world_size: int) -> tuple[int, int]:
        """``(micro_batch_size, accumulation steps)`` for ``world_size`` ranks."""
        micro = self.micro_batch_size or max(1, self.global_batch_size // world_size)
        if self.global_batch_size % (micro * world_size):
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={micro} x world_size={world_size}"
            )
        return micro, self.global_batch_size // (micro * world_size)


@dataclass
class RunConfig:
    """Everything one run needs; ``trainer.run.recipes`` returns these."""

    recipe: str = "custom"
    """Name of the recipe this config came from."""
    seed: int = 0
    """Seed of the initial weights, the data order and the interventions."""
    project: str | None = None
    """Collector project (None: the agent's QKWATCH_PROJECT or default)."""
    run_name: str | None = None
    """Collector run name (None: QKWATCH_RUN, or one made up and kept in <out>/run.json)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    raa: RAAConfig = field(default_factory=RAAConfig)
    init: InitConfig = field(default_factory=InitConfig)
    intervention: InterventionConfig = field(default_factory=InterventionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        m = self.model.resolved()
        if self.model.key_rotation:
            raise ValueError("model.key_rotation is set from raa.enabled / raa.rotation / raa.reflections; leave it 0")
        for key, layers in (("init.qk_layers", self.init.qk_layers), ("intervention.layers", self.intervention.layers)):
            bad = [i for i in layers or [] if i >= m.n_layers]
            if bad:
                raise ValueError(f"{key} has layers {bad} beyond model.n_layers={m.n_layers}")
        if self.init.qk_regime == "disjoint_support_xavier" and m.head_dim > m.d_model // 2:
            raise ValueError(
                f"init.qk_regime=disjoint_support_xavier needs model.d_head <= d_model/2 "
                f"({m.head_dim} > {m.d_model // 2})"
            )
        if self.intervention.kind == "qk_decouple" and self.init.qk_regime != "qk_identical":
            raise ValueError("intervention.kind=qk_decouple starts from equal Q/K: set init.qk_regime=qk_identical")
        if self.train.seq_len is not None and self.train.seq_len > m.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if self.raa.fallback_lambdas is not None and len(self.raa.fallback_lambdas) != m.n_layers:
            raise ValueError(
                f"raa.fallback_lambdas has {len(self.raa.fallback_lambdas)} values for model.n_layers={m.n_layers}"
            )
        if self.raa.rank is not None and self.raa.rank > m.head_dim:
            raise ValueError(f"raa.rank={self.raa.rank} exceeds model.d_head={m.head_dim}")
        if self.model.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.model.vocab_size} is below the byte tokenizer's 256")

    def model_config(self) -> ModelConfig:
        """The model's config with RAA's architectural part (the key rotation) filled in."""
        rotation = self.raa.reflections if self.raa.uses_rotation else 0
        return dataclasses.replace(self.model, key_rotation=rotation).resolved()

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len

    def to_dict(self) -> dict[str, Any]:
        """The run's config as sent to the collector: everything, plus the keys it reads directly."""
        out = dataclasses.asdict(self)
        out["model"] = dataclasses.asdict(self.model_config())
        out["variant"] = self.model.variant
        out["schedule"] = dataclasses.asdict(self.raa.schedule)
        return out


# --- overrides ---------------------------------------------------------------------------------


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``config`` with ``key=value`` overrides applied; ValueError naming a bad key or value.

    All overrides are applied first and the result is validated once, so fields that depend on
    each other (``model.n_layers`` and ``init.qk_layers``) can be set in any order.
    """
    tree = _tree(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. model.n_layers=6")
        _set(config, tree, key.split("."), raw.strip(), key)
    return _rebuild(config, tree)


def _tree(obj: Any) -> dict[str, Any]:
    return {
        f.name: _tree(v) if dataclasses.is_dataclass(v := getattr(obj, f.name)) else v for f in dataclasses.fields(obj)
    }


def _rebuild(obj: T, tree: dict[str, Any]) -> T:
    """The dataclasses of ``obj``'s shape from ``tree``, innermost first (each ``__post_init__`` runs)."""
    values = {
        name: _rebuild(getattr(obj, name), value)
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(obj, name))
        else value
        for name, value in tree.items()
    }
    return type(obj)(**values)


def _set(obj: Any, tree: dict[str, Any], path: list[str], raw: str, key: str) -> None:
    names = {f.name for f in dataclasses.fields(obj)}
    name = path[0]
    if name not in names:
        where = key[: len(key) - len(".".join(path))].rstrip(".") or "the run config"
        raise ValueError(f"unknown config key {key!r}: {where} has {', '.join(sorted(names))}")
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        if len(path) == 1:
            raise ValueError(f"config key {key!r} is a section; set one of its fields, e.g. {key}.{_first(current)}")
        _set(current, tree[name], path[1:], raw, key)
    elif len(path) > 1:
        parent = ".".join(key.split(".")[: -len(path) + 1])
        raise ValueError(f"unknown config key {key!r}: {parent} is not a section")
    else:
        tree[name] = parse_value(raw, typing.get_type_hints(type(obj))[name], key)


def _first(section: Any) -> str:
    return dataclasses.fields(section)[0].name


def parse_value(raw: str, tp: Any, key: str) -> Any:
    """Parse ``raw`` as type ``tp`` (int, float, bool, str, a ``Literal`` choice, lists, ``X | None``)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:  # a choice: the section's __post_init__ names the allowed values
        return raw
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return parse_value(raw, inner[0], key)
    try:
        if tp is bool:
            lowered = raw.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if typing.get_origin(tp) is list:
            items = json.loads(raw) if raw.startswith("[") else [s for s in raw.split(",") if s.strip()]
            return [parse_value(str(i), args[0], key) for i in items]
    except (ValueError, json.JSONDecodeError):
        pass
    name = tp.__name__ if isinstance(tp, type) else str(tp)
    raise ValueError(f"--set {key}={raw!r}: not a valid {name}")
