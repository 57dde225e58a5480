"""The wire schema: value codec, strictness, strict-JSON serialisation."""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.contract.values import MAX_LAYERS, decode_value, encode_value
from qkwatch.contract.wire import OverridesPut, Report, ReportBatch, RunConfig, RunCreate


@pytest.mark.parametrize(
    ("wire", "value"), [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), (0.5, 0.5), (None, None)]
)
def test_codec_round_trip(wire, value):
    decoded = decode_value(wire)
    assert (math.isnan(decoded) and math.isnan(value)) if wire == "nan" else decoded == value
    assert encode_value(decoded) == wire


def test_decode_refuses_other_strings():
    with pytest.raises(ValueError, match="NaN"):
        decode_value("NaN")


def test_report_serialises_non_finite_floats_as_strings():
    r = Report(
        step=3,
        time=1.0,
        layers={"qkai": [0.1, math.nan, None]},
        heads={"qkai": [[math.inf], None]},
        scalars={"loss": -math.inf},
    )
    text = json.dumps(r.model_dump(mode="json"), allow_nan=False)  # strict JSON or it raises
    assert json.loads(text)["layers"]["qkai"] == [0.1, "nan", None]
    assert json.loads(text)["heads"]["qkai"] == [["inf"], None]
    assert r.point_count() == 4


@pytest.mark.parametrize(
    "bad",
    [
        {"step": "3", "time": 1.0},
        {"step": 3.0, "time": 1.0},
        {"step": -1, "time": 1.0},
        {"step": 3, "time": "1"},
        {"step": 3, "time": 1.0, "layers": {"qkai": ["0.1"]}},
        {"step": 3, "time": 1.0, "layers": {"qkai": [True]}},
        {"step": 3, "time": 1.0, "layers": {"bad metric": [0.1]}},
        {"step": 3, "time": 1.0, "extra": 1},
    ],
)
def test_report_is_strict(bad):
    with pytest.raises(ValidationError):
        Report.model_validate(bad)


def test_batch_needs_a_uuid_and_reports():
    with pytest.raises(ValidationError):
        ReportBatch.model_validate({"batch_id": str(uuid.uuid4()), "reports": []})
    with pytest.raises(ValidationError):
        ReportBatch.model_validate({"batch_id": "x", "reports": [{"step": 0, "time": 0}]})


def test_run_names_refuse_whitespace_slashes_and_control_characters():
    for name in ("a b", "a/b", "a\x00b", ""):
        with pytest.raises(ValidationError):
            RunCreate(project="p", name=name)
    assert RunCreate(project="p", name="run-1.x").attempt_key is None


def test_overrides_accept_numbers_and_null_only():
    assert OverridesPut.model_validate({"3": 0, "4": None}).root == {"3": 0.0, "4": None}
    with pytest.raises(ValidationError):
        OverridesPut.model_validate({"3": "0.1"})


# --- the run config: schedule and n_layers typed, everything else free-form -------------------


def test_the_run_config_is_typed_once_and_keeps_every_other_key() -> None:
    free = {"lr": 3e-4, "recipe": {"name": "collapse", "layers": [1, "x", None]}, "seed": 10**30, "copy": 1}
    body = RunCreate(project="p", name="r", config={"schedule": {"beta": 0.1, "lambda_0": 1}, "n_layers": 6, **free})
    assert body.config.schedule == ScheduleConfig(beta=0.1, lambda_0=1.0)
    assert isinstance(body.config.schedule.lambda_0, float) and body.config.n_layers == 6
    assert body.config.model_extra == free
    assert body.config.as_dict() == {"schedule": dataclasses.asdict(body.config.schedule), "n_layers": 6, **free}


def test_keys_not_given_are_not_added() -> None:
    assert RunCreate(project="p", name="r").config.as_dict() == {}
    config = RunConfig.model_validate({"lr": 0.1})
    assert config.schedule == ScheduleConfig() and config.n_layers is None and config.as_dict() == {"lr": 0.1}
    assert RunConfig.model_validate({"schedule": None}).schedule == ScheduleConfig()


BAD_SCHEDULES = [
    ({"beta": 0}, "config.schedule.beta"),
    ({"beta": -0.5}, "config.schedule.beta"),
    ({"ema": 1.0}, "config.schedule.ema"),
    ({"ema": -0.1}, "config.schedule.ema"),
    ({"h_star": "0.8"}, "config.schedule.h_star"),
    ({"beta": True}, "config.schedule.beta"),
    ({"lambda_0": 10**400}, "config.schedule.lambda_0"),
    ({"floor": None}, "config.schedule.floor"),
    ({"lambda_max": [1.0]}, "config.schedule.lambda_max"),
    ({"gamma": 1.0}, "config.schedule.gamma"),
    ("fast", "config.schedule must be an object"),
    ([["beta", 0.1]], "config.schedule must be an object"),
]


@pytest.mark.parametrize(("schedule", "named"), BAD_SCHEDULES)
def test_a_bad_schedule_is_refused_naming_the_field(schedule: Any, named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RunCreate(project="p", name="r", config={"schedule": schedule})
    (error,) = caught.value.errors()
    assert error["loc"] == ("config", "schedule") and named in error["msg"]
    assert len(error["msg"]) < 200  # a 401-digit int is described, not printed


@pytest.mark.parametrize("n_layers", [0, -1, MAX_LAYERS + 1, 10**400, True, False, 2.0, "12", [4]])
def test_a_bad_layer_count_is_refused_naming_the_field(n_layers: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        RunCreate(project="p", name="r", config={"n_layers": n_layers})
    (error,) = caught.value.errors()
    assert error["loc"] == ("config", "n_layers") and "config.n_layers" in error["msg"]


def test_the_bounds_of_free_form_json_hold_for_the_config() -> None:
    with pytest.raises(ValidationError, match="bytes as JSON"):
        RunCreate(project="p", name="r", config={"notes": "x" * 300_000})
    with pytest.raises(ValidationError, match="a valid dictionary"):
        RunCreate.model_validate({"project": "p", "name": "r", "config": [1]})


def test_the_schema_describes_the_schedule_from_its_dataclass() -> None:
    """OpenAPI (and so clients and the fuzzer) sees the schedule's parameters and nothing else."""
    config = RunCreate.model_json_schema()["$defs"]["RunConfig"]
    schedule = config["properties"]["schedule"]
    assert set(schedule["properties"]) == {f.name for f in dataclasses.fields(ScheduleConfig)}
    assert schedule["additionalProperties"] is False and config["additionalProperties"] is True
    n_layers = config["properties"]["n_layers"]["anyOf"][0]
    assert (n_layers["type"], n_layers["minimum"], n_layers["maximum"]) == ("integer", 1, MAX_LAYERS)
