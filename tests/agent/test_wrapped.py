"""Attention is found wherever the model sits: held by a plain module or a LightningModule, inside
DDP, compiled before or after attaching; and each wrapper reports the same values as the bare model.

The reference is the same model (same weights, same batch) attached bare; every per-layer value of
the wrapped report must equal it (compiled: within 1e-6, the eager backend keeps the kernels).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from qkwatch import agent
from tests.agent.test_invisible import CASES, one_thread  # noqa: F401 (a fixture)
from tests.agent.test_probe import OFFLINE, spooled
from tests.live import free_port

MODELS = ["gpt2-sdpa", "llama-eager", "bert-sdpa"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


class Holder(nn.Module):
    """The pattern people write: the transformer as an attribute of their own module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def lightning_module(model: nn.Module) -> nn.Module:
    import lightning.pytorch as L

    class LitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model  # the standard pattern: no module= given to qkwatch

    return LitLM()


@pytest.fixture
def process_group() -> Iterator[None]:
    """A real one-process gloo group, so DDP wraps for real."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(
    root: nn.Module, forward: Callable[[], Any], tmp_path: Path, name: str
) -> tuple[list[str], dict[str, list]]:
    a = agent.attach(root, spool=str(tmp_path / name), run=name, every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        forward()
    (report,) = [r for r in spooled(a) if r["layers"]]
    return [s.name for s in a.sites], report["layers"]


def batch() -> dict[str, torch.Tensor]:
    x = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    return {"input_ids": x, "attention_mask": mask}


def same(a: dict[str, list], b: dict[str, list], tol: float = 0.0) -> None:
    assert set(a) == set(b)
    for metric, values in a.items():
        for x, y in zip(values, b[metric], strict=True):
            close = abs(x - y) <= tol * max(1.0, abs(y)) if x is not None and y is not None else False
            assert (x is None and y is None) or (math.isnan(x) and math.isnan(y)) or x == y or close, (metric, x, y)


@pytest.mark.parametrize("wrapper", ["plain module", "LightningModule"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_model_held_by_another_module_is_found_without_module(kind: str, wrapper: str, tmp_path: Path) -> None:
    model = CASES[kind].build().eval()
    x = batch()
    bare_names, bare = measure(model, lambda: model(**x), tmp_path, "bare")
    root = Holder(model) if wrapper == "plain module" else lightning_module(model)
    names, wrapped = measure(root, lambda: model(**x), tmp_path, "wrapped")
    assert names == [f"model.{n}" for n in bare_names]  # each layer named by its path in what was attached
    same(bare, wrapped)


@pytest.mark.parametrize("kind", MODELS)
def test_a_ddp_wrapped_model_is_found_through_its_module(kind: str, tmp_path: Path, process_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = CASES[kind].build().eval()
    x = batch()
    bare_names, bare = measure(model, lambda: model(**x), tmp_path, "bare")
    ddp = DDP(model)
    names, wrapped = measure(ddp, lambda: ddp(**x), tmp_path, "ddp")
    assert names == [f"module.{n}" for n in bare_names]
    same(bare, wrapped)


@pytest.mark.parametrize("order", ["compiled, then attached", "attached, then compiled"])
@pytest.mark.parametrize("kind", ["gpt2-sdpa", "llama-eager"])
def test_a_compiled_model_reports_what_the_bare_one_does(kind: str, order: str, tmp_path: Path) -> None:
    model = CASES[kind].build().eval()
    x = batch()
    _, bare = measure(model, lambda: model(**x), tmp_path, "bare")
    if order == "compiled, then attached":
        compiled = torch.compile(model, backend="eager")
        _, got = measure(compiled, lambda: compiled(**x), tmp_path, "compiled")
    else:
        a = agent.attach(model, spool=str(tmp_path / "late"), run="late", every=1, **OFFLINE)
        compiled = torch.compile(model, backend="eager")
        a.step(0)
        with torch.no_grad():
            compiled(**x)
        (report,) = [r for r in spooled(a) if r["layers"]]
        got = report["layers"]
    same(bare, got, tol=1e-6)


@pytest.mark.slow
def test_an_fsdp2_sharded_model_held_by_a_module_reports_what_the_unsharded_one_does(tmp_path: Path) -> None:
    """Two gloo ranks; rank 0 measures layers 0 and 2 of 3 (``layer % world``): those equal the
    unsharded model's, the weights read where FSDP2 has them whole."""
    import json
    import subprocess

    from tests.live import ROOT

    out = tmp_path / "out.json"
    done = subprocess.run(
        [*TORCHRUN, "-m", "tests.agent.fsdp_hf", str(tmp_path / "spool"), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["names"] == [f"model.model.layers.{i}.self_attn" for i in range(2)]
    for metric in ("qkai", "stable_rank", "qk_cos", "attn_entropy", "attn_top1", "pr_q"):
        for layer in (0,):  # rank 0's share of the 2 layers
            got, want = result["sharded"][metric][layer], result["unsharded"][metric][layer]
            assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (metric, layer)


def test_a_peft_lora_model_is_measured_with_the_weights_it_computes_with(tmp_path: Path) -> None:
    """LoRA on q_proj and k_proj (B drawn at random, so the adapters matter): the report equals that
    of the same model with the adapters merged into the weights; the LoRA model's outputs are left
    bit for bit as they were. Within 1e-5 relative: LoRA computes ``x W^T + s (x A^T) B^T``, the merged
    model ``x (W + s B A)^T``, which round differently."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = CASES["llama-sdpa"].build().eval()
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    merged = copy.deepcopy(lora).merge_and_unload()
    x = batch()
    with torch.no_grad():
        before = lora(**x).logits
    names, got = measure(lora, lambda: lora(**x), tmp_path, "lora")
    _, want = measure(merged, lambda: merged(**x), tmp_path, "merged")
    with torch.no_grad():
        assert torch.equal(lora(**x).logits, before)
    assert names[0] == "base_model.model.model.layers.0.self_attn"
    assert got["qkai"] != measure(base, lambda: base(**x), tmp_path, "base")[1]["qkai"]  # the adapters count
    same(want, got, tol=1e-5)
