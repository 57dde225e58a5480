"""Every step of the instability sweep, kept: the runs as one compressed file, and read back from it alone.

``python -m experiments.instability`` reads the runs from its collector once and writes
``experiments/results/<name>_runs.npz``; every outcome, score and table of ``docs/instability.md`` is
then recomputed from that file, without the collector (``tests/experiments/test_instability_data.py``
checks that a round trip keeps every value). Per run, under the key ``<run>/<field>``:

* ``loss_steps``, ``loss`` (float64: as logged, NaN and infinities kept), ``grad_norm``, ``lr``: every step;
* ``val_steps``, ``val_loss``: the held-out evaluations;
* ``report_steps``, ``report_attempts`` and, per per-layer metric ``m``, ``layers/m`` (float32, reports x
  layers; the agent measures in float32, so nothing is rounded) with ``measured/m`` (a layer the
  report did not measure is not a NaN it measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qkwatch.client.rest import Client
from qkwatch.client.run_history import RunHistory, read
from qkwatch.rules.transitions import ReportValues

SCALARS = ("loss", "grad_norm", "lr")
"""Run-level scalars kept at every logged step."""


@dataclass
class RunRecord:
    """One run as the file keeps it."""

    name: str
    history: RunHistory
    """Its reports and training loss, as :func:`qkwatch.client.run_history.read` gives them."""
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    scalars: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """``grad_norm`` and ``lr``: steps and values."""


def fetch(client: Client, campaign: str, names: Sequence[str]) -> list[RunRecord]:
    """Every run of ``names`` read from the collector: reports, loss, held-out loss, the other scalars."""
    out = []
    for name in names:
        ref = f"{campaign}/{name}"
        history = read(client, ref)
        history = RunHistory(name, history.reports, history.loss_steps, history.losses)
        val = client.series(ref, "val_loss")
        scalars = {}
        for key in SCALARS[1:]:
            series = client.series(ref, key)
            scalars[key] = (list(series.steps), [math.nan if v is None else float(v) for v in series.values])
        values = [math.nan if v is None else float(v) for v in val.values]
        out.append(RunRecord(name, history, list(val.steps), values, scalars))
    return out


def export(runs: Sequence[Any], campaign: str, path: Path) -> Path:
    """Add every run of ``runs`` (each with a ``name``) that the campaign's collector holds finished to ``path``.

    The file is a sweep's memory across machines: the runs it holds are kept as they are and not
    trained again (``experiments.instability`` skips them), so a sweep stopped on one machine goes on
    from the committed file on another.
    """
    from experiments.common import Campaign, log

    kept = load(path) if path.exists() else {}
    with Campaign(campaign) as c:
        new = [r.name for r in runs if r.name not in kept and c.finished(r.name)]
        records = {r.name: r for r in fetch(c.client, campaign, new)}
    merged = {**kept, **records}
    save([merged[r.name] for r in runs if r.name in merged], path)
    log(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {len(merged)} of {len(runs)} runs, "
        f"{len(records)} added from the collector"
    )
    return path


def save(records: Sequence[RunRecord], path: Path) -> Path:
    """Write ``records`` to one compressed ``.npz`` (see the module docstring for its keys)."""
    arrays: dict[str, np.ndarray] = {}
    for r in records:
        h = r.history
        arrays[f"{r.name}/loss_steps"] = np.asarray(h.loss_steps, dtype=np.int32)
        arrays[f"{r.name}/loss"] = np.asarray(h.losses, dtype=np.float64)
        arrays[f"{r.name}/val_steps"] = np.asarray(r.val_steps, dtype=np.int32)
        arrays[f"{r.name}/val_loss"] = np.asarray(r.val_loss, dtype=np.float64)
        for key, (steps, values) in r.scalars.items():
            arrays[f"{r.name}/{key}_steps"] = np.asarray(steps, dtype=np.int32)
            arrays[f"{r.name}/{key}"] = np.asarray(values, dtype=np.float64)
        reports = sorted(h.reports, key=lambda x: (x.attempt, x.step))
        arrays[f"{r.name}/report_steps"] = np.asarray([x.step for x in reports], dtype=np.int32)
        arrays[f"{r.name}/report_attempts"] = np.asarray([x.attempt for x in reports], dtype=np.int16)
        for metric in sorted({m for x in reports for m in x.layers}):
            width = max(len(x.layers.get(metric) or []) for x in reports)
            grid = np.full((len(reports), width), np.nan, dtype=np.float32)
            measured = np.zeros((len(reports), width), dtype=bool)
            for i, x in enumerate(reports):
                for j, v in enumerate(x.layers.get(metric) or []):
                    if v is not None:
                        grid[i, j], measured[i, j] = v, True
            arrays[f"{r.name}/layers/{metric}"] = grid
            arrays[f"{r.name}/measured/{metric}"] = measured
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def names(path: Path) -> list[str]:
    """The runs a file :func:`save` wrote, without reading their arrays (none when there is no file)."""
    if not path.exists():
        return []
    with np.load(path) as data:
        return list(dict.fromkeys(key.partition("/")[0] for key in data.files))


def load(path: Path) -> dict[str, RunRecord]:
    """The runs of a file :func:`save` wrote, by name, in the order they were saved."""
    with np.load(path) as data:
        fields: dict[str, dict[str, np.ndarray]] = {}
        for key in data.files:
            name, _, rest = key.partition("/")
            fields.setdefault(name, {})[rest] = data[key]
    return {name: _record(name, f) for name, f in fields.items()}


def _record(name: str, f: Mapping[str, np.ndarray]) -> RunRecord:
    metrics = [k.removeprefix("layers/") for k in f if k.startswith("layers/")]
    reports = []
    for i, (step, attempt) in enumerate(zip(f["report_steps"], f["report_attempts"], strict=True)):
        layers = {
            m: [float(v) if ok else None for v, ok in zip(f[f"layers/{m}"][i], f[f"measured/{m}"][i], strict=True)]
            for m in metrics
        }
        reports.append(
            ReportValues(
                int(attempt), int(step), {m: _trim(v) for m, v in layers.items() if any(x is not None for x in v)}
            )
        )
    history = RunHistory(name, reports, [int(s) for s in f["loss_steps"]], [float(v) for v in f["loss"]])
    scalars = {
        key: ([int(s) for s in f[f"{key}_steps"]], [float(v) for v in f[key]]) for key in SCALARS[1:] if key in f
    }
    return RunRecord(name, history, [int(s) for s in f["val_steps"]], [float(v) for v in f["val_loss"]], scalars)


def _trim(values: list[float | None]) -> list[float | None]:
    """Without the trailing unmeasured layers (a report lists layers 0..the highest it measured)."""
    while values and values[-1] is None:
        values.pop()
    return values
