"""On a CUDA device: the setups of ``test_setups.py`` where the GPU differs (kept out of ``make test``).

    python -m pytest -q -m gpu tests/integrations/test_gpu_setups.py

* eager against sdpa in bf16, where SDPA runs the flash (or memory-efficient) kernel: the same
  queries and keys reach the agent, so the weight metrics agree exactly and the row statistics
  within bf16's rounding;
* ``torch.compile`` (inductor, Triton kernels) before attach: the report within bf16's rounding of
  the eager model's;
* bf16 autocast on the GPU: the weight metrics read in fp32 (autocast off), equal to fp32's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qkwatch import agent
from tests.agent.test_invisible import CASES
from tests.agent.test_probe import OFFLINE, spooled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WEIGHTS = ("qkai", "stable_rank", "qk_cos")
ROWS = ("attn_entropy", "attn_top1", "attn_top5")


def batch() -> dict[str, torch.Tensor]:
    x = torch.randint(1, 50, (4, 64), generator=torch.Generator().manual_seed(6)).cuda()
    mask = torch.ones_like(x)
    mask[1, :9] = 0
    return {"input_ids": x, "attention_mask": mask}


def report(model: torch.nn.Module, tmp_path: Path, name: str, forward: Any = None) -> dict:
    a = agent.attach(model, spool=str(tmp_path / name), run=name, every=1, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        (forward if forward is not None else model)(**batch())
    (r,) = [r for r in spooled(a) if r["layers"]]
    return r["layers"]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_eager_and_flash_sdpa_agree_in_bf16(kind: str, tmp_path: Path) -> None:
    eager = report(CASES[f"{kind}-eager"].build().eval().to("cuda", torch.bfloat16), tmp_path, "eager")
    with torch.nn.attention.sdpa_kernel(
        [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
    ):
        sdpa = report(CASES[f"{kind}-sdpa"].build().eval().to("cuda", torch.bfloat16), tmp_path, "sdpa")
    for m in WEIGHTS:
        assert sdpa[m] == eager[m], m
    for m in ROWS:
        assert sdpa[m] == pytest.approx(eager[m], abs=0.02), m
    print(f"{kind}: eager vs flash sdpa, bf16: entropy {sdpa['attn_entropy']} vs {eager['attn_entropy']}")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_inductor_compiled_reports_what_eager_does(kind: str, tmp_path: Path) -> None:
    model = CASES[f"{kind}-sdpa"].build().eval().to("cuda", torch.bfloat16)
    plain = report(model, tmp_path, "plain")
    compiled = torch.compile(model)
    got = report(compiled, tmp_path, "compiled", forward=compiled)
    for m in (*WEIGHTS, *ROWS):
        assert got[m] == pytest.approx(plain[m], abs=0.02, rel=0.02), m
    print(f"{kind}: inductor on CUDA: {got['attn_entropy']} vs {plain['attn_entropy']}")


def test_bf16_autocast_on_the_gpu_reads_weights_in_fp32(tmp_path: Path) -> None:
    model = CASES["llama-sdpa"].build().eval().cuda()
    fp32 = report(model, tmp_path, "fp32")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = report(model, tmp_path, "bf16")
    for m in WEIGHTS:
        assert low[m] == fp32[m], m
    for m in ROWS:
        assert low[m] == pytest.approx(fp32[m], abs=0.02), m
