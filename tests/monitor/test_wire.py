"""The wire schema: value codec, strictness, strict-JSON serialisation."""

from __future__ import annotations

import json
import math
import uuid

import pytest
from pydantic import ValidationError

from qkwatch.monitor.wire import OverridesPut, Report, ReportBatch, RunCreate, decode_value, encode_value


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
