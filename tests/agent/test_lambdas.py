"""The lambdas the agent hands the trainer: the collector's vector validated value by value.

A valid value applies; one above ``lambda_max`` is clipped to it; a non-finite or negative one
gives way to the local schedule's value for that layer; a vector of the wrong length is refused
and the last good values stay. Each clip or refusal is warned about once and becomes one event
of the next report.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from qkwatch.agent.lambdas.lambdas import Lambdas
from qkwatch.contract.scheduling import ScheduleConfig, entropy_floor

N = 4
SCHEDULE = ScheduleConfig(lambda_0=0.1, h_star=0.75, beta=0.05, lambda_max=0.2)
ENTROPY = {0: 0.7, 1: 0.8, 2: 0.9, 3: 0.75}


def lambdas(n: int = N) -> Lambdas:
    lam = Lambdas(n, SCHEDULE, sync_every=1, stale_seconds=60.0)
    lam.observe(ENTROPY)  # the local schedule has a value for every layer
    return lam


def local(layer: int) -> float:
    return entropy_floor([ENTROPY[layer]], SCHEDULE)[0]


def qkwatch_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "qkwatch.agent.lambdas.lambdas" and r.levelno == logging.WARNING
    ]


def test_valid_values_are_applied_as_served() -> None:
    lam = lambdas()
    assert lam.offer({"version": 3, "lambdas": [0.0, 0.05, 0.2, 0.1]})
    assert lam.current(0) == [0.0, 0.05, 0.2, 0.1]
    assert lam.source == "collector" and lam.version == 3
    assert lam.take_events() == []


def test_a_value_above_lambda_max_is_clipped_and_the_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    lam = lambdas()
    for _ in range(3):  # the poller asks again and again: one warning, one event
        assert lam.offer({"version": 1, "lambdas": [0.0, 0.5, 0.02, 0.1]})
    assert lam.current(0) == [0.0, 0.2, 0.02, 0.1]
    assert lam.source == "collector"
    (warning,) = qkwatch_warnings(caplog)
    assert "layer 1" in warning and "0.5" in warning and "lambda_max=0.2" in warning
    (event,) = lam.take_events()
    assert event["kind"] == "lambda_clipped"
    assert event["data"] == {"layers": [{"layer": 1, "requested": 0.5, "applied": 0.2}], "lambda_max": 0.2}
    assert lam.take_events() == []  # taken once
    lam.offer({"version": 2, "lambdas": [0.0, 0.7, 0.02, 0.1]})  # another requested value: said again
    assert len(qkwatch_warnings(caplog)) == 2
    assert lam.take_events()[0]["data"]["layers"] == [{"layer": 1, "requested": 0.7, "applied": 0.2}]


@pytest.mark.parametrize("bad", [math.nan, "nan", "inf", -0.01, None, "0.1", True])
def test_a_non_finite_negative_or_non_number_value_takes_the_local_schedule(bad: object) -> None:
    lam = lambdas()
    assert lam.offer({"version": 1, "lambdas": [0.01, bad, 0.02, 0.03]})
    assert lam.current(0) == pytest.approx([0.01, local(1), 0.02, 0.03])
    assert local(1) > 0  # (so the test can tell it from a zero)
    (event,) = lam.take_events()
    assert event["kind"] == "lambda_invalid" and event["data"]["layers"][0]["layer"] == 1
    assert event["data"]["layers"][0]["applied"] == "local schedule"


def test_a_vector_of_the_wrong_length_is_refused_and_the_last_good_values_stay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lam = lambdas()
    assert lam.offer({"version": 1, "lambdas": [0.01, 0.02, 0.03, 0.04]})
    for _ in range(3):
        assert not lam.offer({"version": 2, "lambdas": [0.1, 0.1, 0.1]})
    assert not lam.offer({"version": 2})  # no vector at all
    assert lam.current(0) == [0.01, 0.02, 0.03, 0.04] and lam.version == 1
    warnings = qkwatch_warnings(caplog)
    assert len(warnings) == 2 and "3 values for 4 layers" in warnings[0]  # once per kind of bad answer
    (event,) = lam.take_events()
    assert event["kind"] == "lambdas_refused"
    assert event["data"]["refused"] == [
        {"requested": 3, "applied": "last good values"},
        {"requested": "NoneType", "applied": "last good values"},
    ]


def test_events_of_several_layers_and_kinds_make_one_event_per_kind() -> None:
    lam = lambdas()
    lam.offer({"version": 1, "lambdas": [0.9, "nan", 0.3, -1.0]})
    assert lam.current(0) == pytest.approx([0.2, local(1), 0.2, local(3)])
    events = {e["kind"]: e for e in lam.take_events()}
    assert [i["layer"] for i in events["lambda_clipped"]["data"]["layers"]] == [0, 2]
    assert [i["layer"] for i in events["lambda_invalid"]["data"]["layers"]] == [1, 3]
    assert "layers [0, 2]" in events["lambda_clipped"]["message"]


def _two_ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        lam = Lambdas(N, SCHEDULE, sync_every=1, stale_seconds=60.0, group=dist.group.WORLD)
        lam.observe({layer: h for layer, h in ENTROPY.items() if layer % 2 == rank})  # each rank its own layers
        if rank == 0:
            lam.offer({"version": 5, "lambdas": [0.01, "nan", 0.9, 0.03]})  # layer 1's value: rank 1's schedule
        Path(f"{out}.{rank}").write_text(json.dumps(lam.current(0)))
    finally:
        dist.destroy_process_group()


def test_with_two_ranks_a_replaced_value_is_the_owning_ranks_local_one(tmp_path: Path) -> None:
    out = str(tmp_path / "applied")
    mp.spawn(_two_ranks, args=(f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    expected = pytest.approx([0.01, local(1), 0.2, 0.03])
    assert json.loads(Path(f"{out}.0").read_text()) == expected
    assert json.loads(Path(f"{out}.1").read_text()) == expected  # every rank switches to the same values
