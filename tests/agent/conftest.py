"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qkwatch.agent.shipping import disk_spool, spool_memory
from tests.agent.faults import Answer, FaultyOs, Hostile, mount_tmpfs


@pytest.fixture(scope="module")
def megatron_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One process, tensor and pipeline parallel size 1, over gloo."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = tmp_path_factory.mktemp("megatron") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def megatron_on_cpu(megatron_parallel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two CUDA-only calls in Megatron-core 0.16's forward that are not attention (module docstring)."""
    from megatron.core import tensor_parallel

    class NoCudaRng:
        def fork(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: NoCudaRng())


@pytest.fixture
def hostile() -> Iterator[Callable[..., Hostile]]:
    """``hostile(every_other=False, **answers)``: a :class:`Hostile` collector, closed after the test."""
    made: list[Hostile] = []

    def make(every_other: bool = False, **answers: Answer) -> Hostile:
        made.append(Hostile(every_other, **answers))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def faulty_os(monkeypatch: pytest.MonkeyPatch) -> FaultyOs:
    """The spool module's ``os``, with a ``write`` the test can make fail or fall short."""
    fake = FaultyOs()
    monkeypatch.setattr(disk_spool, "os", fake)
    monkeypatch.setattr(spool_memory, "RETRY_SECONDS", 0.0)
    return fake


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, unmounted after the test."""
    mount = tmp_path / "disk"
    mount_tmpfs(mount, "256k")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
