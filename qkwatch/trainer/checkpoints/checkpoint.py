"""Checkpoints: sharded DCP checkpoints for resuming, and a plain-file export for analysis.

* Resume: ``torch.distributed.checkpoint`` (DCP) saves the model and AdamW state as every rank
  holds them (FSDP2 shards) plus the step, in ``<out>/checkpoints/step-NNNNNNN/``. It is written to
  a ``.tmp`` folder and renamed once complete, so a crash mid-save leaves the previous checkpoint
  as the latest. The learning rate and the data are functions of the step, and the initial weights
  that interventions refer to are functions of the seed, so nothing else needs saving.
* Safety (``trainer.checkpoints.safety``): a checkpoint never runs code, carries checksums checked
  on load, and a corrupted, foreign or crafted one raises :class:`BadCheckpoint`, one line naming
  the file (the CLI's exit 2).
* Analysis: :func:`export_model` writes ``{"format": "qkwatch-gpt", "config": asdict(model.config),
  "model": full state dict, "sha256": {name: digest of each tensor's bytes}, "meta": {"step", "run",
  "recipe", "seed"}}`` with ``torch.save`` (what ``qkwatch analyze`` and ``qkwatch eval`` read);
  :func:`load_exported` checks the digests and builds the GPT back from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

# DCP's save where it is defined (``torch.distributed.checkpoint`` re-exports it without marking it
# as exported, which a strict type checker refuses)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from qkwatch.agent.metrics import tensor_sha256
from qkwatch.trainer.checkpoints.safety import (
    LOCAL_STATE,
    BadCheckpoint,
    load_dcp,
    one_line,
    read_checksums,
    read_local_state,
    verify_export,
    write_checksums,
)
from qkwatch.trainer.checkpoints.safety import barrier as _barrier
from qkwatch.trainer.checkpoints.safety import is_main as _is_main
from qkwatch.trainer.checkpoints.safety import single_process_ok as _single_process_ok

if TYPE_CHECKING:
    from qkwatch.trainer.model.gpt import GPT

logger = logging.getLogger(__name__)

FORMAT = "qkwatch-gpt"
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class CheckpointConfig:
    """When to save and what to keep."""

    enabled: bool = True
    """Save DCP checkpoints at all (False: benchmarks and throwaway runs)."""
    every: int = 0
    """Save a DCP checkpoint every this many steps (0: only at the end)."""
    keep: int = 2
    """DCP checkpoints kept (the oldest are deleted)."""
    export: bool = True
    """Write <out>/model.pt (the qkwatch-gpt export) at the end of the run."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")


class Checkpointer:
    """Saves and loads the training state of one run folder."""

    def __init__(self, folder: Path, config: CheckpointConfig) -> None:
        self.folder = Path(folder)
        self.config = config

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = (STEP_DIR.match(p.name) for p in self.folder.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.folder / f"step-{steps[-1]:07d}" if steps else None

    def due(self, step: int, last: bool) -> bool:
        return self.config.enabled and (last or (self.config.every > 0 and step % self.config.every == 0))

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, local_state: dict[str, Any] | None = None
    ) -> Path:
        """Collective: every rank calls it. Returns the checkpoint folder.

        ``local_state`` is this rank's own small JSON state (the monitor's), written beside the
        DCP files as ``local-rank<r>.json``; :meth:`local_states` reads every rank's back.
        """
        final = self.folder / f"step-{step:07d}"
        tmp = self.folder / f"step-{step:07d}.tmp"
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_ok():
            dcp_save({"model": model_sd, "optim": optim_sd, "train": {"step": step}}, checkpoint_id=str(tmp))
        if local_state is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            (tmp / f"local-rank{rank}.json").write_text(json.dumps(local_state))
        _barrier()
        write_checksums(tmp)
        if _is_main():
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in self.steps()[: -self.config.keep]:
                shutil.rmtree(self.folder / f"step-{old:07d}", ignore_errors=True)
        _barrier()
        logger.info("saved checkpoint %s", final)
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load model and optimizer state in place (collective); returns the step it was saved at."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "train": {"step": -1}}
        load_dcp(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        logger.info("resumed from %s (step %d)", path, state["train"]["step"])
        return _step_of(state, path)

    @staticmethod
    def local_states(path: Path) -> list[dict[str, Any]]:
        """Every rank's ``local_state`` saved in checkpoint ``path`` (none for an older checkpoint).

        Only the files its checksums list are read (all ``local-rank*.json`` of an older one).
        """
        return [read_local_state(p) for p in Checkpointer.local_state_files(path)]

    @staticmethod
    def local_state_files(path: Path) -> list[Path]:
        """The ``local-rank<r>.json`` files of checkpoint ``path`` that its checksums list (all, for an older one)."""
        listed = read_checksums(Path(path))
        if listed is None:
            return sorted(Path(path).glob("local-rank*.json"))
        return sorted(Path(path) / n for n in listed if LOCAL_STATE.match(n))


def load_model_state(path: Path, model: nn.Module) -> int:
    """Load only the model weights of a DCP checkpoint into an unsharded model; returns its step."""
    model_sd = get_model_state_dict(model)
    state: dict[str, Any] = {"model": model_sd, "train": {"step": -1}}
    load_dcp(state, path)
    model.load_state_dict(state["model"])
    return _step_of(state, path)


def _step_of(state: dict[str, Any], path: Path) -> int:
    step = state["train"]["step"]
    if type(step) is not int or step < 0:
        raise BadCheckpoint(f"{path}: train.step is {step!r}, not a step number")
    return step


def export_model(model: GPT, path: str | Path, *, meta: dict[str, Any] | None = None) -> None:
    """Write the qkwatch-gpt file: full, unsharded tensors on the CPU (collective under FSDP2).

    ``meta`` (optional: step, run, recipe...) is stored under an extra ``"meta"`` key.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if _is_main():
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sums = {name: tensor_sha256(t) for name, t in state.items() if isinstance(t, torch.Tensor)}
        payload = {"format": FORMAT, "config": dataclasses.asdict(model.config), "model": state, "sha256": sums}
        if meta:
            payload["meta"] = meta
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(path)
    _barrier()


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The GPT of a qkwatch-gpt file, in eval mode; each tensor checked against the file's sha256 list.

    Raises:
        BadCheckpoint: one line naming the file and the fault.
    """
    from qkwatch.trainer.model.config import ModelConfig
    from qkwatch.trainer.model.gpt import GPT

    path = Path(path)
    payload = read_export(path)
    verify_export(payload, path)
    try:
        model = GPT(ModelConfig(**payload["config"])).to(device)
        model.load_state_dict(payload["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise BadCheckpoint(f"{path}: not a model this version can build ({one_line(exc)})") from None
    return model.eval()


def read_export(path: Path) -> dict[str, Any]:
    """The payload of a qkwatch-gpt file, read with ``weights_only=True``."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # not a torch file, truncated, or objects weights_only refuses
        raise BadCheckpoint(f"{path}: cannot be read as a {FORMAT} export ({one_line(exc)})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("model"), dict):
        raise BadCheckpoint(f"{path} is not a {FORMAT} export (no 'format': '{FORMAT}' key with a 'model' dict)")
    return payload
