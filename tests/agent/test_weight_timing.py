"""A report's weight metrics are those of the weights its activations ran with (issue 41, item 5).

In the documented loop (``agent.step(s)``, forward, backward, ``opt.step()``) the report of step
``s`` is packed at the next ``step()`` call, after step ``s``'s optimizer update; its weights must
nevertheless be those of step ``s``'s forward (at step 0, the initial ones). Each test copies the
query and key weights just before the forward of each step and computes QKAI from the copies with
a closed form independent of the agent's code: with ``Q_q``, ``Q_k`` orthonormal bases (numpy's QR)
of a head's query and key column spaces, ``qkai_h = ||Q_q^T Q_k||_F^2 / d_head`` (the mean squared
cosine of the principal angles). Offline agents: reports are read back from their spool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkwatch import agent
from qkwatch.agent.shipping.disk_spool import Spool
from tests.agent.tiny import TinyGPT, batch

FAST = {"spectra_every": 0, "flush_seconds": 0.05}
STEPS = 4
LR = 1e-2  # large enough that one update moves QKAI far beyond the tolerance


def qkai_closed_form(wq: np.ndarray, wk: np.ndarray, n_heads: int) -> float:
    """Mean over heads of ``||Q_q^T Q_k||_F^2 / d_head``; ``wq``, ``wk`` ``(d_model, n_heads * d_head)``,
    head ``h`` in columns ``h * d_head ... (h + 1) * d_head - 1``."""
    d_head = wq.shape[1] // n_heads
    values = []
    for h in range(n_heads):
        cols = slice(h * d_head, (h + 1) * d_head)
        qq, qk = np.linalg.qr(wq[:, cols])[0], np.linalg.qr(wk[:, cols])[0]  # (d_model, d_head)
        values.append(np.linalg.norm(qq.T @ qk) ** 2 / d_head)
    return float(np.mean(values))


def tiny_qkai(model: nn.Module) -> list[float]:
    """Every layer's QKAI of a TinyGPT now (fused ``nn.Linear`` ``c_attn``: rows q, k, v)."""
    out = []
    for block in model.h:
        w = block.attn.c_attn.weight.detach().double().numpy()  # (3 d, d)
        d = w.shape[1]
        out.append(qkai_closed_form(w[:d].T, w[d : 2 * d].T, block.attn.n_head))
    return out


def reports_of(spool_path: Path) -> dict[int, dict]:
    """The spooled reports that carry layer metrics, by step."""
    spool = Spool(spool_path)
    try:
        reports = [r.payload["report"] for r in spool.pending(10_000) if "report" in r.payload]
    finally:
        spool.close()
    return {r["step"]: r for r in reports if r["layers"].get("qkai")}


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def assert_report_matches(reported: list[float], before: list[float], after: list[float]) -> None:
    """The weights of the forward, not those after the update that followed it."""
    np.testing.assert_allclose(reported, before, rtol=1e-4, atol=1e-6)
    assert np.max(np.abs(np.array(before) - np.array(after))) > 1e-3  # the update moved QKAI: the check can fail


@pytest.mark.parametrize(
    ("measure_thread", "accumulate", "compiled"),
    [(True, 1, False), (False, 1, False), (True, 2, False), (True, 1, True)],
    ids=["measure-thread", "training-thread", "accumulation", "compiled"],
)
def test_the_report_of_step_s_carries_the_weights_of_step_s_forward(
    tmp_path: Path, measure_thread: bool, accumulate: int, compiled: bool
) -> None:
    """The documented loop with AdamW: every report, step 0 included, has the QKAI of the weights
    copied just before its step's (first) forward, and not that of the weights after its update.
    With gradient accumulation ``step(s)`` is called before every micro-batch; under
    ``torch.compile`` the weights are read outside the graph, at ``step(s)``."""
    torch.manual_seed(0)
    model = TinyGPT()
    run = torch.compile(model, backend="eager") if compiled else model
    a = agent.attach(model, spool=str(tmp_path), run="timing", every=1, measure_thread=measure_thread, **FAST)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before, after = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            a.step(step)  # a repeat with the same step does nothing: the first micro-batch is measured
            if micro == 0:
                before.append(tiny_qkai(model))  # the weights this step's forward runs with
            (loss_of(run, batch(step * accumulate + micro)) / accumulate).backward()
        opt.step()
        opt.zero_grad()
        after.append(tiny_qkai(model))
    a.close(timeout=0.2)
    reports = reports_of(a.spool_path)
    assert sorted(reports) == list(range(STEPS))
    for step in range(STEPS):
        assert_report_matches(reports[step]["layers"]["qkai"], before[step], after[step])


def test_a_weight_report_on_a_step_without_a_forward_has_the_weights_of_its_step(tmp_path: Path) -> None:
    """Weights due on a step whose forward never runs (weights-only cadence, or a skipped batch):
    the report still has the weights as they were at ``step(s)``, not those its report is packed with."""
    torch.manual_seed(0)
    model = TinyGPT()
    a = agent.attach(model, spool=str(tmp_path), run="no-forward", every=1000, weight_every=1, **FAST)
    before, after = [], []
    for step in range(2):
        a.step(step)
        before.append(tiny_qkai(model))
        with torch.no_grad():  # an update with no forward before it
            for block in model.h:
                block.attn.c_attn.weight.add_(0.05 * torch.randn_like(block.attn.c_attn.weight))
        after.append(tiny_qkai(model))
    a.close(timeout=0.2)
    reports = reports_of(a.spool_path)
    assert sorted(reports) == [0, 1]
    for step in range(2):
        assert_report_matches(reports[step]["layers"]["qkai"], before[step], after[step])
        assert "attn_entropy" not in reports[step]["layers"]  # weights only: no activations were due


def test_the_huggingface_trainer_reports_the_weights_of_each_steps_forward(tmp_path: Path) -> None:
    """HF Trainer with the callback (``on_step_begin``) and two micro-batches per optimizer step: the
    report of global step ``s`` has the weights of the first forward of that step, recorded here by
    a forward pre-hook on the model, independently of the callback."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from qkwatch.integrations.huggingface import QKWatchCallback
    from tests.integrations.hf_tiny import FAST as HF_FAST
    from tests.integrations.hf_tiny import Tokens, arguments, tiny_gpt2

    model = tiny_gpt2()
    forwards: list[list[float]] = []

    def gpt2_qkai() -> list[float]:
        out = []
        for block in model.transformer.h:
            w = block.attn.c_attn.weight.detach().double().numpy()  # Conv1D: (d, 3 d), columns q, k, v
            d = w.shape[0]
            out.append(qkai_closed_form(w[:, :d], w[:, d : 2 * d], block.attn.num_heads))
        return out

    def record(module: nn.Module, args: object) -> None:
        if module.training:
            forwards.append(gpt2_qkai())

    model.register_forward_pre_hook(record)
    watch = QKWatchCallback(project="tests", run="hf-timing", spool=str(tmp_path / "spool"), every=1, **HF_FAST)
    args = arguments(tmp_path / "out", max_steps=STEPS, logging_steps=1, learning_rate=LR, lr_scheduler_type="constant")
    Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[watch]).train()
    reports = reports_of(tmp_path / "spool" / "tests" / "hf-timing" / "rank-0")
    assert sorted(reports) == list(range(STEPS)) and len(forwards) == 2 * STEPS  # 2 micro-batches a step
    for step in range(STEPS):
        first, next_step = forwards[2 * step], (forwards[2 * step + 2] if step + 1 < STEPS else gpt2_qkai())
        assert_report_matches(reports[step]["layers"]["qkai"], first, next_step)
