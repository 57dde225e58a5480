"""Lazy, read-only access to the tensors of a checkpoint on disk.

Nothing is read until a tensor is asked for, and then only that tensor: safetensors files are
memory-mapped by ``safe_open``; ``.bin``/``.pt`` files are loaded with ``torch.load(mmap=True)``,
which maps the zip archive instead of reading it. So the query and key weights of a 7B model can
be read layer by layer without holding the model in memory.

Supported:
* a HuggingFace model folder: ``config.json`` plus ``model.safetensors``, sharded safetensors
  with ``model.safetensors.index.json``, ``pytorch_model.bin`` or its sharded index;
* a single ``.safetensors`` file;
* a single torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): a state dict, qkwatch's own export
  ``{"format": "qkwatch-gpt", "config", "model"}``, or a nanoGPT checkpoint
  ``{"model": ..., "model_args": ...}``.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from qkwatch.agent.metrics.digest import export_fault


class CheckpointError(Exception):
    """The checkpoint cannot be read as asked; the message says why and what to do."""


class _TensorFile(Protocol):
    """An open checkpoint file: safetensors' ``safe_open`` handle or a :class:`_TorchFile`."""

    def get_tensor(self, key: str) -> Tensor: ...


class Checkpoint:
    """A name -> tensor view of a checkpoint that reads each tensor on demand."""

    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        kind: str,
        index: dict[str, Path],
        loaded: dict[str, Tensor] | None = None,
    ):
        self.path = path
        self.config = config
        self.kind = kind
        self._index = index  # key -> file holding it
        self._loaded = loaded or {}  # keys of a torch file already mapped by torch.load(mmap=True)
        self._handles: dict[Path, _TensorFile] = {}

    def keys(self) -> list[str]:
        return list(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def get(self, key: str) -> Tensor:
        if key not in self._index:
            raise CheckpointError(f"{self.path}: no tensor named {key!r}")
        if key in self._loaded:
            return self._loaded[key]
        return self._handle(self._index[key]).get_tensor(key)

    def close(self) -> None:
        self._handles.clear()
        self._loaded.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, file: Path) -> _TensorFile:
        if file not in self._handles:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            else:
                self._handles[file] = _TorchFile(_torch_load(file))
        return self._handles[file]


class _TorchFile:
    def __init__(self, state: dict[str, Tensor]):
        self._state = state

    def get_tensor(self, key: str) -> Tensor:
        return self._state[key]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a model folder or checkpoint file for lazy reading (see the module docstring)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"no such file or directory: {path}")
    if path.is_dir():
        return _open_folder(path)
    if path.suffix == ".safetensors":
        return Checkpoint(path, _sibling_config(path), "safetensors", dict.fromkeys(_safetensors_keys(path), path))
    return _open_torch_file(path)


def _open_folder(folder: Path) -> Checkpoint:
    config = _read_json(folder / "config.json") if (folder / "config.json").exists() else {}
    candidates = [
        ("model.safetensors.index.json", "sharded safetensors"),
        ("model.safetensors", "safetensors"),
        ("pytorch_model.bin.index.json", "sharded torch"),
        ("pytorch_model.bin", "torch"),
    ]
    for name, kind in candidates:
        file = folder / name
        if not file.exists():
            continue
        if not config:
            raise CheckpointError(f"{folder}: found {name} but no config.json (needed for the head counts)")
        if name.endswith(".index.json"):
            weight_map = _read_json(file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{file}: no 'weight_map' object")
            return Checkpoint(folder, config, kind, {k: folder / v for k, v in weight_map.items()})
        if file.suffix == ".safetensors":
            return Checkpoint(folder, config, kind, dict.fromkeys(_safetensors_keys(file), file))
        state = _torch_load(file)
        return Checkpoint(folder, config, kind, dict.fromkeys(state, file), state)
    others = sorted(p.name for p in folder.iterdir())[:12]
    raise CheckpointError(
        f"{folder}: not a model folder: expected config.json with model.safetensors, "
        f"model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json; found {others}"
    )


def _open_torch_file(path: Path) -> Checkpoint:
    obj = _torch_load(path)
    config: dict[str, Any] = {}
    kind = "state dict"
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        if obj.get("format") == "qkwatch-gpt":
            config, kind = dict(obj.get("config") or {}), "qkwatch-gpt"
            config.setdefault("model_type", "qkwatch-gpt")
            _verify_export(path, obj)
        elif isinstance(obj.get("model_args"), dict):
            config, kind = dict(obj["model_args"]), "nanogpt"
            config.setdefault("model_type", "nanogpt")
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict or a known checkpoint format (a dict of tensors)")
    config = config or _sibling_config(path)
    state = {_strip_compile_prefix(k): v for k, v in obj.items()}
    return Checkpoint(path, config, kind, dict.fromkeys(state, path), state)


def _verify_export(path: Path, export: dict[str, Any]) -> None:
    """Each tensor of a qkwatch-gpt export against the export's ``sha256`` list (when it has one)."""
    sums = export.get("sha256")
    if sums is None:  # exported before exports carried checksums
        return
    fault = export_fault({k: v for k, v in export["model"].items() if isinstance(v, Tensor)}, sums)
    if fault:
        raise CheckpointError(f"{path}: {fault}")


def _torch_load(file: Path) -> Any:
    # mmap needs the zip format of torch >= 1.6; legacy files are read whole
    mmap = zipfile.is_zipfile(file)
    try:
        return torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:  # pickle errors, truncated files, a non-torch file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{file}: cannot be read as a torch checkpoint ({type(exc).__name__}: {first_line})"
        ) from None


def _safetensors_keys(file: Path) -> Iterator[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            return iter(list(handle.keys()))
    except Exception as exc:
        raise CheckpointError(f"{file}: cannot be read as safetensors ({exc})") from None


def _sibling_config(path: Path) -> dict[str, Any]:
    config = path.parent / "config.json"
    return _read_json(config) if config.exists() else {}


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot be read as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return value


def _strip_compile_prefix(key: str) -> str:
    return key.removeprefix("_orig_mod.")
