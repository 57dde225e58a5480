"""The Trainer's logs as the agent's scalars: the numbers, by collector metric name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import Tensor

_NOT_IN_METRIC_NAME = re.compile(r"[^A-Za-z0-9_.:/-]")


def scalars(logs: Mapping[str, Any]) -> dict[str, float | Tensor]:
    """The numbers of a Trainer's logs (numbers and one-element tensors; booleans and text left out), by metric name."""
    out: dict[str, float | Tensor] = {}
    for key, value in logs.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[metric_name(key)] = float(value)
        elif isinstance(value, Tensor) and value.numel() == 1:
            out[metric_name(key)] = value.detach().reshape(())
    return out


def metric_name(key: str) -> str:
    """A log key as a collector metric name: ``[A-Za-z_][A-Za-z0-9_.:/-]{0,127}`` (others become ``_``)."""
    name = _NOT_IN_METRIC_NAME.sub("_", key)
    if not name or not (name[0].isascii() and (name[0].isalpha() or name[0] == "_")):
        name = "_" + name
    return name[:128]
