"""Reading a checkpoint without running it, and knowing it is the one that was saved.

* DCP's own reader unpickles ``.metadata`` and loads every non-tensor value (``train.step``, the
  optimizer's hyperparameters) with ``torch.load(weights_only=False)``: a crafted checkpoint runs
  code. :func:`load_dcp` reads ``.metadata`` with an unpickler that allows only the classes of
  torch's checkpoint metadata, and those values with ``weights_only=True``.
* Each checkpoint folder carries ``checksums.json``, the sha256 of every file (:func:`write_checksums`,
  each rank hashing the files it wrote), checked before anything is read (:func:`verify_checksums`).
  The qkwatch-gpt export carries the sha256 of each tensor (:func:`verify_export`).
* A corrupted, foreign or crafted checkpoint raises :class:`BadCheckpoint`: one line naming the file
  and what is wrong (the CLI's exit 2). A checkpoint saved before checksums existed still loads,
  with a warning that it cannot be checked.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

# DCP's load where it is defined (``torch.distributed.checkpoint`` re-exports it without marking
# it as exported, which a strict type checker refuses)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from qkwatch.agent.metrics import export_fault

logger = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
CHECKSUMS_FORMAT = "qkwatch-checkpoint-sha256"


class BadCheckpoint(ValueError):
    """A corrupted, foreign or crafted checkpoint: the message is one line naming the file and the fault."""


def one_line(exc: BaseException) -> str:
    """An exception as ``Type: first line`` (at most 200 characters of it)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: that is intended."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


# --- DCP: a restricted unpickler, plain-data values ------------------------------------------------

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}
"""What a DCP ``.metadata`` pickle references (found by saving real checkpoints): the metadata
dataclasses, the storage info, a layout by name and the path it was saved to. Torch's dtypes and
``torch.Size`` are allowed besides; nothing else is ever imported or called."""


def _refused_global(exc: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused (not its advice to retry with ``weights_only=False``)."""
    found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL (\S+)", str(exc))
    if found:
        return f"it refers to {found.group(1)}: a crafted or foreign checkpoint"
    return type(exc).__name__ if "weights_only" in str(exc) else one_line(exc)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, name: Path) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise BadCheckpoint(
            f"{self.name}: refers to {module}.{name}, which a DCP checkpoint's metadata never holds "
            "(a crafted or foreign checkpoint); nothing was loaded"
        )


def read_metadata(file: Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled with only torch's checkpoint metadata classes allowed."""
    try:
        with file.open("rb") as stream:
            metadata = _MetadataUnpickler(stream, file).load()
    except BadCheckpoint:
        raise
    except Exception as exc:  # truncated, not a pickle, wrong arguments to an allowed class
        raise BadCheckpoint(f"{file}: not a DCP checkpoint's metadata ({one_line(exc)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise BadCheckpoint(f"{file}: not a DCP checkpoint's metadata (holds a {type(metadata).__name__})")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader with the ``.metadata`` that :func:`read_metadata` read in place of its ``pickle.load``."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.metadata = metadata

    # Not ``**kwargs``: DCP passes ``rank=`` (a fallback to per-rank metadata files, which qkwatch
    # never writes) only to a reader whose signature names ``kwargs``.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        metadata = self.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor values read by ``torch.load(weights_only=True)``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            file = self.folder / getattr(info, "relative_path", "?")
            raise BadCheckpoint(
                f"{file}: {fqn} is not plain data ({_refused_global(exc)}); nothing of it was run"
            ) from None
        # what DefaultLoadPlanner.load_bytes does after its torch.load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_dcp(state: dict[str, Any], path: Path) -> None:
    """``dcp_load`` of checkpoint ``path`` into ``state`` in place, checksums checked first, nothing executed.

    Raises:
        BadCheckpoint: one line naming the file and the fault.
    """
    path = Path(path)
    verify_checksums(path)
    reader = _SafeReader(path, read_metadata(path / ".metadata"))
    try:
        with single_process_ok(), _quiet_dcp_errors():
            dcp_load(state, checkpoint_id=str(path), storage_reader=reader, planner=_SafePlanner(path))
    except (Exception, CheckpointException) as exc:
        raise _explain(exc, path) from None


class _DropExceptionEvents(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, dict) and record.msg.get("event") == "exception")


@contextmanager
def _quiet_dcp_errors() -> Iterator[None]:
    """DCP logs each failure with its traceback at ERROR; :func:`load_dcp` raises it as one line instead."""
    from torch.distributed.checkpoint import logger as dcp_logging

    dcp_logger: logging.Logger = dcp_logging._dcp_logger
    quiet = _DropExceptionEvents()
    dcp_logger.addFilter(quiet)
    try:
        yield
    finally:
        dcp_logger.removeFilter(quiet)


def _explain(exc: BaseException, path: Path) -> BadCheckpoint:
    """DCP wraps each rank's error in a CheckpointException (a BaseException): the first one, in one line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    if isinstance(exc, BadCheckpoint):
        return exc
    return BadCheckpoint(f"{path}: cannot be loaded as a checkpoint of this model ({one_line(exc)})")


LOCAL_STATE = re.compile(r"^local-rank\d+\.json$")
"""A rank's monitor state file in a checkpoint folder."""


def read_local_state(file: Path) -> dict[str, Any]:
    """A rank's monitor state file: a JSON object, or a BadCheckpoint naming it."""
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadCheckpoint(f"{file}: not readable JSON ({one_line(exc)})") from None
    if not isinstance(state, dict):
        raise BadCheckpoint(f"{file}: holds a JSON {type(state).__name__}, not the monitor's state object")
    return state


# --- checksums -------------------------------------------------------------------------------------


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    """Collective: ``checksums.json``, the sha256 of every file in ``folder``.

    Each rank hashes the files it wrote (``__<rank>_*.distcp``, ``local-rank<rank>.json``), so a
    large sharded checkpoint is hashed in parallel; rank 0 hashes the rest and writes the list.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {
        p.name: _sha256(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and (p.name.startswith(f"__{rank}_") or p.name == f"local-rank{rank}.json")
    }
    parts: list[dict[str, str]] = [mine]
    if world > 1:
        parts = [{} for _ in range(world)]
        dist.all_gather_object(parts, mine)
    if is_main():
        sums = {name: digest for part in parts for name, digest in part.items()}
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.name not in sums and p.name != CHECKSUMS:
                sums[p.name] = _sha256(p)
        (folder / CHECKSUMS).write_text(json.dumps({"format": CHECKSUMS_FORMAT, "sha256": sums}, indent=1))
    barrier()


def read_checksums(folder: Path) -> dict[str, str] | None:
    """The file -> sha256 list of checkpoint ``folder``, or None for a checkpoint saved without one."""
    file = folder / CHECKSUMS
    if not file.exists():
        return None
    try:
        payload = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadCheckpoint(f"{file}: not readable JSON ({one_line(exc)})") from None
    if not isinstance(payload, dict):
        payload = {}
    sums = payload.get("sha256")
    if payload.get("format") != CHECKSUMS_FORMAT or not isinstance(sums, dict) or ".metadata" not in sums:
        raise BadCheckpoint(f"{file}: not a {CHECKSUMS_FORMAT} list with the checkpoint's .metadata")
    for name, digest in sums.items():
        if Path(name).name != name or name in (".", "..") or not isinstance(digest, str):
            raise BadCheckpoint(f"{file}: names {name!r}, not a file of this folder with its sha256")
    return sums


_warned_unchecked: set[Path] = set()


def verify_checksums(folder: Path) -> None:
    """Check every file of checkpoint ``folder`` against its ``checksums.json`` before anything is read.

    Collective under torch.distributed: the ranks share the files out, and all raise the first fault.
    A checkpoint saved without checksums is warned about once and not checked.
    """
    sums = read_checksums(folder)
    if sums is None:
        if folder not in _warned_unchecked:
            _warned_unchecked.add(folder)
            logger.warning("%s has no %s (saved by an older qkwatch): its files cannot be checked", folder, CHECKSUMS)
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = sorted(sums)[rank::world]
    fault = next((f for f in (_check_file(folder / n, sums[n]) for n in names) if f), None)
    faults: list[str | None] = [fault]
    if world > 1:
        faults = [None] * world
        dist.all_gather_object(faults, fault)
    first = next((f for f in faults if f), None)
    if first:
        raise BadCheckpoint(first)


def _check_file(file: Path, digest: str) -> str | None:
    if not file.is_file():
        return f"{file}: missing (listed in {CHECKSUMS})"
    if _sha256(file) != digest:
        return f"{file}: sha256 differs from {CHECKSUMS} (the file is corrupted or was changed)"
    return None


# --- the qkwatch-gpt export ---------------------------------------------------------------------------


def verify_export(payload: dict[str, Any], path: Path) -> None:
    """Every tensor of an export against its ``sha256`` entry (an export older than checksums is warned about)."""
    sums = payload.get("sha256")
    if sums is None:
        if path not in _warned_unchecked:
            _warned_unchecked.add(path)
            logger.warning("%s has no checksums (exported by an older qkwatch): its weights cannot be checked", path)
        return
    fault = export_fault({name: t for name, t in payload["model"].items() if isinstance(t, torch.Tensor)}, sums)
    if fault:
        raise BadCheckpoint(f"{path}: {fault}")
