"""An activation metric of your own (``qkwatch.agent.metrics.activation_metric``) is measured on the model's
own attention: registered once, it appears in the report per layer, equal to the same function of the
probabilities the model returns with ``output_attentions=True``.

The metric here is the attention mass on key position 0 (an "attention sink"), averaged as the agent
averages (the real rows of a sequence, then the sequences, then the heads). Every row of every sequence
is sampled, on a padded batch, so the agent's value must equal the reference: on OPT (pre-scaled
queries) and Gemma 2 (its own scale, a soft-cap, a sliding window), tiny random configs. Position 0 is
padding in the left-padded sequence: a row's mass there is 0, which the agent must reproduce too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from qkwatch.agent.metrics import activation_metric, rows
from tests.agent.test_model_scoring import DECODERS, _attach, _padded, sharpen
from tests.agent.test_probe import spooled


@pytest.fixture
def sink_mass() -> Iterator[str]:
    @activation_metric("sink_mass_test")
    def first_key_mass(p: Tensor, seen: Tensor) -> Tensor:
        return (p[..., 0] * seen).sum(-1) / seen.sum(-1)

    try:
        yield "sink_mass_test"
    finally:
        rows.REGISTERED.pop("sink_mass_test", None)


def reference(probs: Tensor, real: np.ndarray) -> float:
    """``probs (B, H, T_q, T_k)``, ``real (B, T_q)``: the mass on key 0 of each real row (rows, sequences, heads)."""
    p = probs.double().numpy()
    per_seq = [p[b][:, np.flatnonzero(real[b]), 0].mean(-1) for b in range(p.shape[0])]  # (H,) each
    return float(np.mean(np.mean(per_seq, axis=0)))


@pytest.mark.parametrize("name", ["opt", "gemma2"])
def test_a_registered_activation_metric_is_the_models_own(name: str, sink_mass: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = sharpen(DECODERS[name]()).eval()
    x, mask = _padded()
    a = _attach(model, tmp_path)
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    (report,) = spooled(a)
    with torch.no_grad():
        probs = model(input_ids=x, attention_mask=mask, output_attentions=True).attentions
    measured = report["layers"][sink_mass]
    assert len(measured) == len(probs) == 2
    for layer, p in enumerate(probs):
        want = reference(p, mask.numpy())
        assert measured[layer] == pytest.approx(want, abs=2e-6), layer
    assert len({round(v, 4) for v in measured}) == 2  # the layers differ: not one value copied


def test_a_name_taken_is_refused(sink_mass: str) -> None:
    for taken in ("attn_entropy", "qkai", "pr_gap", sink_mass):
        with pytest.raises(ValueError, match=f"a metric named {taken!r} exists already"):
            activation_metric(taken)(lambda p, seen: p.sum(-1).mean(-1))
