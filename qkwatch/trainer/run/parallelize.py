"""Process group, device mesh and FSDP2, applied from outside the model (torchtitan style).

``parallelize(model, config, env)`` applies, in this order, activation checkpointing (composable
``checkpoint``, which keeps the module names), ``torch.compile`` per block (``Module.compile``, in
place, names kept) and FSDP2: ``fully_shard`` on every block, then on the root. On a GPU the
parameters are gathered in bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``); on the
CPU everything is fp32. NCCL on GPUs, gloo with an explicit CPU device mesh on the CPU.

``trainer.model.init.build_model`` builds a model on the meta device, calls ``parallelize`` on it, then
materialises it with ``to_empty`` and initialises it shard by shard: no rank ever holds the whole
model. This module knows nothing of how a model is built or initialised.
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from qkwatch.trainer.model.gpt import GPT

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ParallelConfig:
    """Devices, sharding, precision and the speed options."""

    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    param_dtype: str = "auto"
    """Dtype of the gathered parameters for compute: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward."""
    compile: bool = False
    """torch.compile each block."""
    compile_backend: str = "inductor"
    """Backend for torch.compile."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each block's forward (ZeRO-3); False keeps them (ZeRO-2)."""
    timeout_s: float = 600.0
    """Process-group timeout."""
    cpu_threads: int | None = None
    """Intra-op threads on the CPU (None: torch's default, all cores). Small models run many tiny
    kernels whose thread wake-ups cost more than they save, badly so on a busy machine: 1 there."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"parallel.device={self.device!r} is not one of auto, cpu, cuda")
        if self.param_dtype not in ("auto", *DTYPES):
            raise ValueError(f"parallel.param_dtype={self.param_dtype!r} is not one of auto, float32, bfloat16")
        if self.reduce_dtype not in DTYPES:
            raise ValueError(f"parallel.reduce_dtype={self.reduce_dtype!r} is not one of float32, bfloat16")
        if self.timeout_s <= 0:
            raise ValueError("parallel.timeout_s must be > 0")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"parallel.cpu_threads must be >= 1 or None, got {self.cpu_threads}")


@dataclass
class Env:
    """Where this process runs."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None
    """The 1-D data-parallel DeviceMesh, or None when not distributed."""
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    owns_group: bool = False
    """This process group was created by init_distributed (and close_distributed destroys it)."""

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self) -> AbstractContextManager[object]:
        """bf16 autocast for a single unsharded process on a GPU (FSDP2 handles precision otherwise)."""
        if not self.distributed and self.device.type == "cuda" and self.param_dtype == torch.bfloat16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_distributed(config: ParallelConfig) -> Env:
    """Join the process group when launched by torchrun (any world size); else a single process."""
    wants_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("parallel.device=cuda but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if wants_cuda else torch.device("cpu")
    if wants_cuda:
        torch.cuda.set_device(device)
    if not wants_cuda and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    param_dtype = DTYPES.get(config.param_dtype) or (torch.bfloat16 if wants_cuda else torch.float32)
    reduce_dtype = DTYPES[config.reduce_dtype]
    if not launched_by_torchrun():
        return Env(0, 1, device, None, param_dtype, reduce_dtype)
    from torch.distributed.device_mesh import init_device_mesh

    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if wants_cuda else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.timeout_s))
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return Env(dist.get_rank(), world, device, mesh, param_dtype, reduce_dtype, owns_group=owns)


def close_distributed(env: Env) -> None:
    """Destroy the process group if init_distributed created it (idempotent)."""
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def parallelize(model: GPT, config: ParallelConfig, env: Env) -> GPT:
    """Activation checkpointing, compile and FSDP2 on a :class:`qkwatch.trainer.model.gpt.GPT`; returns it."""
    if config.activation_checkpointing:
        from torch.distributed._composable.checkpoint_activation import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if config.compile:
        for block in model.blocks:
            block.compile(backend=config.compile_backend)
    if env.distributed:
        apply_fsdp(model, env, config.reshard_after_forward)
    return model


def apply_fsdp(model: GPT, env: Env, reshard_after_forward: bool = True) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=env.param_dtype, reduce_dtype=env.reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=env.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=env.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if dist.get_backend() == "gloo":
        # pytorch#162338: gloo once silently summed where FSDP2 asked for ReduceOp.AVG. Ask for a
        # SUM and FSDP2's own division instead (tests/trainer/test_distributed.py holds the result).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
