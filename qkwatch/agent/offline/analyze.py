"""``qkwatch analyze``: the weight geometry of a checkpoint on disk, layer by layer.

Reads only the query and key projections, a chunk of layers at a time (bounded memory on
large models), and computes the weight metrics of docs/metrics.md batched over the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkwatch.agent.metrics import householder, split_heads, split_qkv
from qkwatch.agent.metrics.summary import HEAD_METRICS, weight_metrics
from qkwatch.agent.models.layouts import Layout, LayoutError, count_layers, detect, first
from qkwatch.agent.offline.checkpoint import Checkpoint, CheckpointError, open_checkpoint

CHUNK_BYTES = 512 * 2**20
"""Float32 bytes of query+key weights processed in one batched call."""


class AnalyzeError(Exception):
    """The checkpoint cannot be analysed; the message names the problem."""


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int


@dataclass
class Analysis:
    model: str
    layout: str
    shape: Shape
    rank: int
    layers: list[dict[str, float]] = field(default_factory=list)
    """One dict per layer: ``layer`` and each metric."""
    heads: list[dict[str, list[float]]] | None = None
    """With ``heads=True``: one dict per layer, metric -> per-head values."""


def analyze(
    path: str | Path,
    *,
    rank: int | None = None,
    heads: bool = False,
    spectra: bool = True,
    layout: Layout | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Analysis:
    """Weight metrics of every layer of the checkpoint at ``path``.

    Args:
        layout: where the projections are (:func:`qkwatch.agent.models.layouts.custom` makes one from key
            patterns); None, or one carrying only head counts, detects it from the checkpoint's keys.

    Raises:
        AnalyzeError: missing path, unknown layout, or a tensor whose shape does not fit the config.
    """
    given = layout or Layout()
    try:
        with open_checkpoint(path) as ckpt:
            layout = given
            if not given.names_projections:
                layout = replace(detect(ckpt.keys(), ckpt.config), n_heads=given.n_heads, n_kv_heads=given.n_kv_heads)
            shape = _shape(ckpt, layout)
            r = shape.d_head if rank is None else rank
            if not 1 <= r <= shape.d_head:
                raise AnalyzeError(f"--rank must be in [1, d_head={shape.d_head}], got {r}")
            result = Analysis(_model_name(ckpt), layout.name, shape, r, heads=[] if heads else None)
            for start, stop in _chunks(shape):
                wq, wk, rot = _load(ckpt, layout, shape, range(start, stop))
                per_layer, per_head = weight_metrics(wq, wk, rot, rank=r, spectra=spectra)
                _collect(result, range(start, stop), per_layer, per_head)
                if progress:
                    progress(stop, shape.n_layers)
            return result
    except (CheckpointError, LayoutError) as exc:
        raise AnalyzeError(str(exc)) from None


def _shape(ckpt: Checkpoint, layout: Layout) -> Shape:
    config, keys = ckpt.config, ckpt.keys()
    n_layers = count_layers(layout, keys)
    declared = first(config, layout.layers)
    if declared is not None and int(declared) != n_layers:
        raise AnalyzeError(
            f"the config declares {declared} layers but the checkpoint holds query/key weights for "
            f"{n_layers} ({', '.join(layout.weight_keys(n_layers))} is missing)"
        )
    n_heads = layout.n_heads or first(config, layout.heads)
    if n_heads is None:
        raise AnalyzeError(
            "the number of attention heads is unknown: the config has none of "
            f"{', '.join(layout.heads)}; pass --n-heads"
        )
    n_kv = layout.n_kv_heads or first(config, layout.kv_heads) or n_heads
    d_model = first(config, layout.width) or _width_from_weights(ckpt, layout)
    d_head = first(config, layout.head_dim) or d_model // n_heads
    n_heads, n_kv, d_model, d_head = int(n_heads), int(n_kv), int(d_model), int(d_head)
    if n_heads % n_kv:
        raise AnalyzeError(f"{n_heads} attention heads cannot share {n_kv} key/value heads (n_heads % n_kv_heads != 0)")
    return Shape(n_layers, n_heads, n_kv, d_model, d_head)


def _width_from_weights(ckpt: Checkpoint, layout: Layout) -> int:
    weight = ckpt.get(layout.weight_keys(0)[0])
    return int(weight.shape[0] if layout.conv1d else weight.shape[-1])


def _chunks(shape: Shape) -> list[tuple[int, int]]:
    per_layer = 4 * shape.d_model * shape.d_head * (shape.n_heads + shape.n_kv_heads)
    size = max(1, CHUNK_BYTES // per_layer)
    return [(s, min(s + size, shape.n_layers)) for s in range(0, shape.n_layers, size)]


def _load(ckpt: Checkpoint, layout: Layout, shape: Shape, layers: range) -> tuple[Tensor, Tensor, Tensor | None]:
    """Stacked ``(L, H, D, hs)`` query and ``(L, G, D, hs)`` key factors and the rotations."""
    wq, wk, rot = [], [], []
    for i in layers:
        q, k = _layer_qk(ckpt, layout, shape, i)
        wq.append(q)
        wk.append(k)
        key = layout.rotation_key(i)
        if key and key in ckpt:
            rot.append(householder(ckpt.get(key).float()))
    rotation = torch.stack(rot) if rot else None
    return torch.stack(wq), torch.stack(wk), rotation


def _layer_qk(ckpt: Checkpoint, layout: Layout, shape: Shape, i: int) -> tuple[Tensor, Tensor]:
    h, g, d, hs = shape.n_heads, shape.n_kv_heads, shape.d_model, shape.d_head
    if layout.qkv:
        (key,) = layout.weight_keys(i)
        weight = ckpt.get(key)
        rows = (h + 2 * g) * hs
        if tuple(weight.shape) == (rows, d):
            conv1d = False
        elif tuple(weight.shape) == (d, rows):
            conv1d = True
        else:
            raise AnalyzeError(_shape_message(key, weight, (rows, d), shape, "a fused QKV projection"))
        wq, wk, _ = split_qkv(weight.float(), h, g, conv1d=conv1d, split=layout.split or "qkv")
        return wq, wk
    q_key, k_key = layout.weight_keys(i)
    q, k = ckpt.get(q_key), ckpt.get(k_key)
    for key, weight, rows in ((q_key, q, h * hs), (k_key, k, g * hs)):
        if tuple(weight.shape) != (rows, d):
            raise AnalyzeError(_shape_message(key, weight, (rows, d), shape, "an nn.Linear (out, in) weight"))
    return split_heads(q.float(), h), split_heads(k.float(), g)


def _shape_message(key: str, weight: Tensor, expected: tuple[int, int], shape: Shape, what: str) -> str:
    return (
        f"{key} has shape {tuple(weight.shape)}, but the config (d_model={shape.d_model}, "
        f"n_heads={shape.n_heads}, n_kv_heads={shape.n_kv_heads}, d_head={shape.d_head}) expects "
        f"{expected} for {what}"
    )


def _collect(result: Analysis, layers: range, per_layer: dict[str, Tensor], per_head: dict[str, Tensor]) -> None:
    table = {name: values.tolist() for name, values in per_layer.items()}  # one host copy per chunk
    heads = {name: values.tolist() for name, values in per_head.items()}
    for j, i in enumerate(layers):
        result.layers.append({"layer": i, **{name: float(vals[j]) for name, vals in table.items()}})
        if result.heads is not None:
            result.heads.append({name: [float(v) for v in heads[name][j]] for name in HEAD_METRICS})


def _model_name(ckpt: Checkpoint) -> str:
    config: dict[str, Any] = ckpt.config
    name = config.get("_name_or_path") or ""
    if not name and config.get("architectures"):
        name = config["architectures"][0]
    return str(name or ckpt.path.name)


def random_baseline(analysis: Analysis) -> float:
    """QKAI of independent random subspaces, ``r / d_model``: the floor a healthy head sits near."""
    return analysis.rank / analysis.shape.d_model
