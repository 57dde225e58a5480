"""Training tricks people use, each with the agent attached: activation checkpointing, gradient
accumulation (the HF Trainer, Lightning and Accelerate's ``accumulate()``), autocast, and the
attention implementations; and the HF Trainer with checkpointing, accumulation and compile at once.

What each checks: one report per optimizer step, numbered by optimizer steps; no layer counted twice
when a checkpointed forward is recomputed; the values those of the plain setup (exactly where the
queries and keys are the same tensors, within a stated tolerance where the arithmetic differs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from qkwatch import agent
from tests.agent.test_invisible import CASES
from tests.agent.test_probe import OFFLINE, spooled
from tests.agent.tiny import TinyGPT, batch
from tests.integrations.hf_tiny import FAST, Tokens, arguments, tiny_llama


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def x_batch() -> dict[str, torch.Tensor]:
    x = torch.randint(1, 50, (2, 16), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    return {"input_ids": x, "attention_mask": mask, "labels": x}


def one_report(model: torch.nn.Module, tmp_path: Path, name: str, *, backward: bool = True, **settings: Any) -> dict:
    """Attach, arm step 0, one forward (and backward), and the report."""
    a = agent.attach(model, spool=str(tmp_path / name), run=name, every=1, **{**OFFLINE, **settings})
    a.step(0)
    out = model(**x_batch())
    if backward:
        out.loss.backward()
    reports = [r for r in spooled(a) if r["layers"]]
    assert len(reports) == 1, [r["step"] for r in reports]
    return reports[0]["layers"]


def test_hf_gradient_checkpointing_measures_each_layer_once_with_the_plain_values(tmp_path: Path) -> None:
    """The recomputed forward in the backward pass calls the attention again: it is not measured
    again, raises nothing, and the report equals the one without checkpointing."""
    plain = CASES["llama-sdpa"].build().train()
    checkpointed = CASES["llama-sdpa"].build().train()
    checkpointed.gradient_checkpointing_enable()
    calls = {"n": 0}
    site_module = checkpointed.model.layers[0].self_attn
    site_module.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    want = one_report(plain, tmp_path, "plain")
    got = one_report(checkpointed, tmp_path, "checkpointed")
    assert calls["n"] == 2  # the forward and its recomputation: the layer ran twice, was measured once
    assert got == want


def test_torch_checkpoint_around_blocks_measures_each_layer_once(tmp_path: Path) -> None:
    model = TinyGPT()

    def forward(idx: torch.Tensor) -> torch.Tensor:
        h = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for block in model.h:
            h = checkpoint(block, h, use_reentrant=False)
        return model.head(model.ln_f(h))

    x = batch(0)[:, :-1]
    reports = []
    for name, fn in (("plain", model), ("checkpointed", forward)):
        a = agent.attach(model, spool=str(tmp_path / name), run=name, every=1, **OFFLINE)
        a.step(0)
        fn(x).square().mean().backward()
        model.zero_grad()
        (report,) = [r for r in spooled(a) if r["layers"]]
        reports.append(report["layers"])
    assert reports[0] == reports[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_reports_within_its_rounding_of_fp32(dtype: torch.dtype, tmp_path: Path) -> None:
    """bf16 keeps 8 bits of mantissa (q and k rounded to about 0.4 %), fp16 11: the row statistics
    move a little; the weight metrics read the fp32 parameters, with autocast off, and do not move."""
    model = CASES["llama-sdpa"].build().eval()
    fp32 = one_report(model, tmp_path, "fp32", backward=False)
    with torch.autocast("cpu", dtype=dtype):
        low = one_report(model, tmp_path, "low", backward=False)
    for metric in ("qkai", "stable_rank", "qk_cos"):
        assert low[metric] == fp32[metric], metric
    for metric in ("attn_entropy", "attn_top1", "attn_top5"):
        assert low[metric] == pytest.approx(fp32[metric], abs=0.01), metric


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_eager_and_sdpa_report_the_same_values(kind: str, tmp_path: Path) -> None:
    """The same queries and keys whatever the implementation (Llama with GQA: 4 query heads on 2 key
    heads): every value equal to float32 rounding (relative and absolute 1e-5; pr_gap is a difference
    of two participation ratios of about 30, whose float32 Grams round to a few 1e-6)."""
    eager = one_report(CASES[f"{kind}-eager"].build().eval(), tmp_path, "eager", backward=False)
    sdpa = one_report(CASES[f"{kind}-sdpa"].build().eval(), tmp_path, "sdpa", backward=False)
    assert set(eager) == set(sdpa)
    for metric, values in eager.items():
        for e, s in zip(values, sdpa[metric], strict=True):
            assert (math.isnan(e) and math.isnan(s)) or e == pytest.approx(s, rel=1e-5, abs=1e-5), (metric, e, s)


def test_accelerate_accumulate_reports_once_per_optimizer_step(tmp_path: Path) -> None:
    """Accelerate's own loop: ``agent.step(optimizer steps done)`` before every micro-batch; a repeated
    step does nothing, so each optimizer step's first micro-batch is measured, once."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Tokens(24), batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    a = agent.attach(model, spool=str(tmp_path), run="accelerate", every=1, **OFFLINE)
    done = 0
    for item in loader:
        a.step(done)
        with accelerator.accumulate(model):
            loss = model(**item).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            a.log(done, loss=loss.detach())
            done += 1
    steps = [r["step"] for r in spooled(a) if r["layers"]]
    assert done == 6 and steps == list(range(6))


def test_hf_trainer_with_checkpointing_accumulation_and_compile(tmp_path: Path) -> None:
    """``gradient_checkpointing=True``, ``gradient_accumulation_steps=2`` and ``torch_compile=True``
    (inductor on the CPU): a report at every optimizer step, every layer measured in each."""
    from transformers import Trainer

    from qkwatch.integrations.huggingface import QKWatchCallback

    qk = QKWatchCallback(project="tests", run="tricks", spool=str(tmp_path / "spool"), every=1, **FAST)
    args = arguments(
        tmp_path / "out", max_steps=4, gradient_checkpointing=True, gradient_accumulation_steps=2, torch_compile=True
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(32), callbacks=[qk])
    trainer.train()
    from qkwatch.agent.shipping.disk_spool import Spool

    spool = Spool(tmp_path / "spool" / "tests" / "tricks" / "rank-0")
    try:
        reports = [r.payload["report"] for r in spool.pending(1000) if "report" in r.payload]
    finally:
        spool.close()
    measured = [r for r in reports if r["layers"].get("attn_entropy")]
    assert [r["step"] for r in measured] == [0, 1, 2, 3]
    assert all(len(r["layers"]["attn_entropy"]) == 3 and None not in r["layers"]["attn_entropy"] for r in measured)
    assert all(r["layers"]["qkai"] and None not in r["layers"]["qkai"] for r in measured)


def test_lightning_and_the_hf_trainer_number_reports_by_optimizer_step(tmp_path: Path) -> None:
    """Both with two micro-batches per optimizer step and 6 optimizer steps: reports at steps 0-5."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader
    from transformers import Trainer

    from qkwatch.integrations.huggingface import QKWatchCallback as HFCallback
    from qkwatch.integrations.lightning import QKWatchCallback as LCallback

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, item: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self.model(**item).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def steps(spool: Path, run: str) -> list[int]:
        from qkwatch.agent.shipping.disk_spool import Spool

        s = Spool(spool / "tests" / run / "rank-0")
        try:
            return [r.payload["report"]["step"] for r in s.pending(1000) if r.payload.get("report", {}).get("layers")]
        finally:
            s.close()

    lit_cb = LCallback(project="tests", run="lit", spool=str(tmp_path / "lit"), every=1, **FAST)
    L.Trainer(
        max_steps=6,
        accumulate_grad_batches=2,
        callbacks=[lit_cb],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(Lit(), DataLoader(Tokens(48), batch_size=2))
    hf_cb = HFCallback(project="tests", run="hf", spool=str(tmp_path / "hf"), every=1, **FAST)
    args = arguments(tmp_path / "out", max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(48), callbacks=[hf_cb]).train()
    assert steps(tmp_path / "lit", "lit") == steps(tmp_path / "hf", "hf") == list(range(6))
