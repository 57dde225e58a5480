"""A history answer (``GET /v1/runs/{id}/history``, either encoding) as columns.

Plain columns (:func:`history_columns`) or a pandas DataFrame (:func:`history_frame`), through
:class:`HistoryGrid`, each metric decoded (NaN where not measured).
"""

from __future__ import annotations

import base64
import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qkwatch.contract.values import decode_value


@dataclass(frozen=True)
class HistoryGrid:
    """One metric of a history answer, decoded: ``values`` step-major, NaN where not measured."""

    steps: list[int]
    layers: list[int]
    values: array[float]
    measured: bytes | None
    """One byte per value, 1 = measured; None when all were."""

    @classmethod
    def of(cls, g: dict[str, Any]) -> HistoryGrid:
        if g.get("values_f64") is not None:  # encoding=f64
            values = array("d")
            values.frombytes(base64.b64decode(g["values_f64"]))
            if sys.byteorder == "big":
                values.byteswap()
            return cls(g["steps"], g["layers"], values, base64.b64decode(g["measured"]) if g["measured"] else None)
        flat = [v for row in g["values"] for v in row]
        measured = bytes(v is not None for v in flat) if None in flat else None
        return cls(
            g["steps"],
            g["layers"],
            array("d", (math.nan if v is None else v for v in map(decode_value, flat))),
            measured,
        )


def _grids(body: dict[str, Any]) -> tuple[dict[str, HistoryGrid], list[int], list[int]]:
    """The metrics of a history answer, and the steps and layers of them all."""
    grids = {name: HistoryGrid.of(g) for name, g in body["metrics"].items()}
    steps = sorted(set().union(*(g.steps for g in grids.values())))
    layers = sorted(set().union(*(g.layers for g in grids.values())))
    return grids, steps, layers


def _on(grid: HistoryGrid, steps: list[int], layers: list[int]) -> Sequence[float | None]:
    """A metric's values laid out on the (steps x layers) of all metrics, step-major; None: not measured."""
    flat: Sequence[float | None] = grid.values.tolist()
    if grid.measured is not None:
        flat = [v if m else None for v, m in zip(flat, grid.measured, strict=True)]
    if grid.steps == steps and grid.layers == layers:
        return flat
    out: list[float | None] = [None] * (len(steps) * len(layers))
    si, li = {s: i for i, s in enumerate(steps)}, {la: i for i, la in enumerate(layers)}
    cols, width = [li[la] for la in grid.layers], len(grid.layers)
    for r, step in enumerate(grid.steps):
        base = si[step] * len(layers)
        for j, v in zip(cols, flat[r * width : (r + 1) * width], strict=True):
            out[base + j] = v
    return out


def history_columns(body: dict[str, Any]) -> dict[str, list[int] | list[float | None]]:
    """A history answer (either encoding) as plain columns: ``step``, ``layer`` and one per metric, a row
    per (step, layer) that any metric measured, ordered by step and layer; None where not measured."""
    grids, steps, layers = _grids(body)
    flats = {name: _on(g, steps, layers) for name, g in grids.items()}
    cells = zip(*flats.values(), strict=True)
    keep = [i for i, cell in enumerate(cells) if any(v is not None for v in cell)] if flats else []
    n = len(layers)
    out: dict[str, list[int] | list[float | None]] = {
        "step": [steps[i // n] for i in keep],
        "layer": [layers[i % n] for i in keep],
    }
    for name, flat in flats.items():
        out[name] = [flat[i] for i in keep]
    return out


def history_frame(body: dict[str, Any]) -> Any:
    """A history answer (either encoding) as a pandas DataFrame (see :meth:`Client.history`)."""
    import pandas as pd

    grids, steps, layers = _grids(body)
    if not grids:
        return pd.DataFrame({"step": pd.Series([], dtype="int64"), "layer": pd.Series([], dtype="int64")})
    columns, keep = {}, None
    for name, g in grids.items():
        values = pd.Series(g.values, dtype="float64").to_numpy().reshape(len(g.steps), len(g.layers))
        measured = (
            (
                pd.Series(list(g.measured), dtype=bool)
                if g.measured is not None
                else pd.Series(True, index=range(len(g.values)))
            )
            .to_numpy()
            .reshape(values.shape)
        )
        if g.steps != steps or g.layers != layers:  # lay it out on the grid of all metrics
            values = pd.DataFrame(values, index=g.steps, columns=g.layers).reindex(index=steps, columns=layers)
            measured = pd.DataFrame(measured, index=g.steps, columns=g.layers).reindex(
                index=steps, columns=layers, fill_value=False
            )
            values, measured = values.to_numpy(), measured.to_numpy()
        columns[name] = values.ravel()
        keep = measured.ravel() if keep is None else keep | measured.ravel()
    index = {
        "step": pd.Index(steps, dtype="int64").repeat(len(layers))[keep],
        "layer": pd.Index(layers * len(steps), dtype="int64")[keep],
    }
    return pd.DataFrame(index | {name: values[keep] for name, values in columns.items()})
