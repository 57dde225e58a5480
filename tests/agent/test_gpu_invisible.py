"""On a CUDA device: attaching changes nothing there either, and the masked metrics hold.

Run on a GPU machine (kept out of ``make test`` by the ``gpu`` marker)::

    python -m pytest -q -m gpu tests/agent/test_gpu_invisible.py

On the GPU the probe measures inside the hook (no worker thread), queuing its kernels on the
model's stream, and SDPA dispatches to the flash and memory-efficient kernels. The model's own two
runs without the agent are compared first: where the GPU's kernels are not bitwise repeatable
(atomics in a backward), the attached run must be as close to the reference as the reference is
to itself; where they are, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.agent.test_invisible import CASES, _attached, _batch, _logits_and_grads, _measured_every_layer
from tests.agent.test_masked_metrics import _padded, _row_reference
from tests.agent.test_probe import spooled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _flash_available() -> bool:
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        return False
    return bool(is_flash_attn_2_available())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding", ["unpadded", "left-padded"])
@pytest.mark.parametrize("name", list(CASES))
def test_attach_changes_nothing_on_cuda(name: str, padding: str, dtype: torch.dtype, tmp_path: Path) -> None:
    case = CASES[name]
    if padding != "unpadded" and not case.padded:
        pytest.skip("takes no attention mask")
    model = case.build().eval().to("cuda", dtype)
    x, mask = (t.cuda() for t in _batch(padding))
    use_mask = mask if case.padded else None
    first = _logits_and_grads(model, x, use_mask)
    second = _logits_and_grads(model, x, use_mask)
    repeatable = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    a = _attached(case, model, tmp_path, name)
    after = _logits_and_grads(model, x, use_mask)
    _measured_every_layer(a)
    for i, (b, c, d) in enumerate(zip(first, after, second, strict=True)):
        what = "logits" if i == 0 else f"grad {i - 1}"
        if repeatable:
            assert torch.equal(b, c), (name, what, (b - c).abs().max().item())
        else:
            own = (b.float() - d.float()).abs().max().item()
            assert (b.float() - c.float()).abs().max().item() <= max(own, 0.0) * 2 + 1e-30 or torch.equal(b, c), what
    print(f"{name} {padding} {str(dtype)[6:]}: repeatable={repeatable}, attached equal to the reference")


@pytest.mark.parametrize("name", ["llama-sdpa", "bert-sdpa", "gpt2-eager"])
def test_masked_row_statistics_on_cuda(name: str, tmp_path: Path) -> None:
    """The in-hook GPU path: a padded batch against the model's own probabilities (eager, fp32)."""
    from qkwatch import agent
    from tests.agent.test_masked_metrics import B
    from tests.agent.test_probe import OFFLINE

    model = CASES[name].build().eval().cuda()
    x, mask = (t.cuda() for t in _padded())
    a = agent.attach(model, spool=str(tmp_path), run="gpu", every=1, sample_rows=B * 12, sample_seqs=B, **OFFLINE)
    a.step(0)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    for layer, p in enumerate(probs):
        want = _row_reference(p.double().cpu().numpy(), mask.cpu().numpy(), not name.startswith("bert"))
        for metric, value in want.items():
            assert report["layers"][metric][layer] == pytest.approx(value, abs=1e-5), (metric, layer)
    print(f"{name}: entropy {np.round(report['layers']['attn_entropy'], 4).tolist()} equals the reference")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_flash_attention_2_when_installed(kind: str, tmp_path: Path) -> None:
    """bf16 logits and gradients of a padded batch under ``flash_attention_2``, attached or not."""
    print(f"transformers flash_attention_2 available: {_flash_available()}")
    if not _flash_available():
        pytest.skip("flash_attn is not installed on this machine")
    from tests.agent.test_invisible import _hf

    case = CASES[f"{kind}-sdpa"]
    model = _hf(kind, "flash_attention_2")().eval().to("cuda", torch.bfloat16)
    x, mask = (t.cuda() for t in _batch("left-padded"))
    first = _logits_and_grads(model, x, mask)
    a = _attached(case, model, tmp_path, kind)
    after = _logits_and_grads(model, x, mask)
    _measured_every_layer(a)
    assert all(torch.equal(b, c) for b, c in zip(first, after, strict=True))
