"""Fixtures shared by the agent's tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch


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
