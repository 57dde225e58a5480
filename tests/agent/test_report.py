"""A packed and encoded report is what the collector accepts: a valid ``contract.wire.Report``."""

from __future__ import annotations

import json
import math

import torch

from qkwatch.agent.health import DropNotes, Health, health_scalars
from qkwatch.agent.report import Packer, encode, missing_layers_event
from qkwatch.contract.values import decode_value
from qkwatch.contract.wire import Report


def packed_report(n_layers: int = 3):
    packer = Packer()
    packer.metrics(
        layers={0: {"qkai": torch.tensor(0.25)}, 2: {"qkai": torch.tensor(math.nan), "pr_q": torch.tensor(math.inf)}},
        heads={2: {"qkai": torch.tensor([0.1, 0.2, -math.inf, 0.4])}},
    )
    packer.scalar("loss", torch.tensor(2.5))
    packer.scalar("lr", 3e-4)
    packer.layer_values("par", torch.tensor([0.5, 1.5, 2.5]))
    packer.layer_values("lambda", [0.0, 0.01, 0.02])
    for name, value in health_scalars(Health(sent=3), spool_bytes=10, overhead=1e-5, suffix="_rank1").items():
        packer.scalar(name, value)
    events = [missing_layers_event([1], ["h.1.attn"], rank=1, world=2, step=7)]
    return packer.pack(7, 1.7e9, events)


def test_an_encoded_report_validates_as_the_wire_report_and_is_strict_json() -> None:
    report = encode(packed_report(), n_layers=3)
    wire = Report.model_validate(report)
    json.dumps(report, allow_nan=False)  # the spool writes strict JSON
    assert wire.step == 7 and wire.time == 1.7e9
    assert report["layers"]["qkai"] == [0.25, None, "nan"]  # layer 1 not measured: None, never 0
    assert report["layers"]["pr_q"] == [None, None, "inf"]
    assert report["heads"]["qkai"][2][2] == "-inf" and report["heads"]["qkai"][:2] == [None, None]
    assert [decode_value(v) for v in report["layers"]["par"]] == [0.5, 1.5, 2.5]
    assert report["layers"]["lambda"] == [0.0, 0.01, 0.02]
    assert report["scalars"]["loss"] == 2.5 and report["scalars"]["lr"] == 3e-4
    assert report["scalars"]["agent_sent_total_rank1"] == 3.0
    assert wire.events[0].kind == "missing_layers_rank1" and wire.events[0].data["layers"] == [1]
    assert wire.point_count() == 2 + 1 + 4 + 3 + 3 + 2 + 6  # qkai, pr_q, heads, par, lambda, scalars


def test_an_empty_report_and_the_dropped_event_validate() -> None:
    report = encode(Packer().pack(0, 1.0, []), n_layers=2)
    assert report == {"step": 0, "time": 1.0, "layers": {}, "scalars": {}}
    notes = DropNotes(already=2, suffix="")
    notes.note(report, dropped=2)
    assert "events" not in report  # no growth, no event
    notes.note(report, dropped=5)
    wire = Report.model_validate(report)
    assert report["scalars"]["agent_dropped_total"] == 5.0
    assert wire.events[0].kind == "dropped" and wire.events[0].data == {"count": 3}


def test_packing_is_one_tensor_whatever_the_values() -> None:
    packed = packed_report()
    assert packed.values.dtype == torch.float32 and packed.values.dim() == 1
    assert packed.values.numel() == 3 + 4 + 1 + 3  # layer values, one layer's heads, loss, par
    assert packed.ready is None
