"""A run's reports read from its spool on disk, with no collector: ``qkwatch.read_reports(spool_dir)``.

The agent writes every report to its spool before anything sends it (``qkwatch.agent.shipping.disk_spool``),
and offline (no URL) or with the collector down they stay there. This reads them back: every
segment file of every rank's spool, in the order written, without taking the spool's lock (a
running agent may keep writing; a record it is still writing is not read yet). Records the
collector already acknowledged are read too while their segment is still on disk (the agent deletes
a segment once every record of it is delivered), so a spool drained by a collector holds only its
newest reports.

Standard library and pydantic only (the contract's own): ``import qkwatch; qkwatch.read_reports(...)``
loads neither torch nor the collector.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qkwatch.contract.spool_format import SEGMENT_GLOB, scan, segment_number
from qkwatch.contract.wire import Report

META = "meta.json"
"""The file that makes a directory one rank's spool (its run's project, name, config, rank)."""


class SpoolError(ValueError):
    """A path that is not a qkwatch spool, or a folder holding the spools of more than one run."""


@dataclass(frozen=True)
class SpoolReports:
    """One run's reports as its spool holds them; iterating it gives the reports.

    ``reports`` holds one :class:`qkwatch.contract.wire.Report` per step, in step order, as the
    collector would store it: the reports of every rank at a step merged (each rank measures its
    own layers; a layer's value is taken from the rank that has it), their scalars and events
    together; a step written twice (a resumed run's later attempt) reads as written last. Values
    are wire values: floats, None for "not measured", and ``"nan"``, ``"inf"``, ``"-inf"``
    (``qkwatch.contract.values.decode_value`` makes floats of them).
    """

    path: Path
    """The folder read."""
    project: str
    run: str
    reports: list[Report]
    damaged: int = 0
    """Records that could not be read and were skipped: corrupt bytes (each stretch counts one) and
    records that are not a valid report."""
    ranks: int = 1
    """Rank spools read (``rank-<r>`` folders)."""
    config: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    status: str | None = None
    """How the run ended, when its agent spooled it: "finished" or "crashed"; None otherwise."""
    status_reason: str | None = None

    def __iter__(self) -> Iterator[Report]:
        return iter(self.reports)

    def __len__(self) -> int:
        return len(self.reports)

    def __getitem__(self, index: int) -> Report:
        return self.reports[index]

    @property
    def steps(self) -> list[int]:
        return [r.step for r in self.reports]


def read_reports(spool_dir: str | Path) -> SpoolReports:
    """Read a run's reports from its spool, offline: no collector, nothing sent, nothing changed.

    Args:
        spool_dir: one rank's spool (``<spool>/<project>/<run>/rank-<r>``, the folder holding
            ``meta.json``), or any folder above the spools of one run (``<spool>/<project>/<run>``;
            every rank is read), such as ``QKWATCH_SPOOL`` when it holds one run.

    Returns:
        The run's reports, one per step in step order, with the count of damaged records skipped
        (:class:`SpoolReports`).

    Raises:
        SpoolError: ``spool_dir`` is missing, holds no spool, or holds the spools of several runs
            (the message names the path, and the runs).
    """
    root = Path(spool_dir)
    spools = _spools(root)
    metas = [_meta(p) for p in spools]
    runs = sorted({(str(m.get("project", "?")), str(m.get("name", "?"))) for m in metas})
    if len(runs) > 1:
        names = ", ".join(f"{p}/{n}" for p, n in runs)
        raise SpoolError(f"{root} holds the spools of {len(runs)} runs ({names}): give the folder of one")
    damaged = 0
    by_step: dict[int, dict[str, Any]] = {}
    end: dict[str, Any] = {}
    for path in spools:
        payloads, bad = _payloads(path)
        damaged += bad
        for payload in payloads:
            if isinstance(payload.get("status"), dict):
                end = payload["status"] if not end or end.get("status") != "crashed" else end
            elif "report" in payload:
                damaged += not _merge(by_step, payload["report"])
    reports = [Report.model_validate(by_step[step]) for step in sorted(by_step)]
    meta = metas[0]
    return SpoolReports(
        path=root,
        project=runs[0][0],
        run=runs[0][1],
        reports=reports,
        damaged=damaged,
        ranks=len(spools),
        config=meta.get("config") or {},
        tags=list(meta.get("tags") or []),
        notes=meta.get("notes"),
        status=end.get("status"),
        status_reason=end.get("reason"),
    )


def _spools(root: Path) -> list[Path]:
    """The spool folders (holding ``meta.json``) at or below ``root``."""
    if not root.is_dir():
        raise SpoolError(f"{root} is not a qkwatch spool: no such folder")
    found = [root] if (root / META).is_file() else sorted({p.parent for p in root.rglob(META)})
    if not found:
        raise SpoolError(f"{root} is not a qkwatch spool: no {META} at or below it")
    return found


def _meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise SpoolError(f"{path} is not a qkwatch spool: {META} is unreadable ({exc})") from None
    if not isinstance(meta, dict):
        raise SpoolError(f"{path} is not a qkwatch spool: {META} is not an object")
    return meta


def _payloads(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every record of one rank's spool in the order written, and the stretches of corrupt bytes skipped."""
    damaged = 0

    def count() -> None:
        nonlocal damaged
        damaged += 1

    payloads = []
    for file in sorted(path.glob(SEGMENT_GLOB), key=segment_number):
        payloads += [r.payload for r in scan(file, 0, number=segment_number(file), damaged=count)]
    return payloads, damaged


def _merge(by_step: dict[int, dict[str, Any]], raw: Any) -> bool:
    """Add one spooled report to its step's; False (and nothing added) if it is not a valid report."""
    try:
        report = Report.model_validate(raw).model_dump(mode="json")
    except ValidationError:
        return False
    into = by_step.get(report["step"])
    if into is None:
        by_step[report["step"]] = report
        return True
    into["time"] = min(into["time"], report["time"])
    for kind in ("layers", "heads"):
        for metric, values in report[kind].items():
            into[kind][metric] = _overlay(into[kind].get(metric), values)
    into["scalars"].update(report["scalars"])
    into["events"] += report["events"]
    return True


def _overlay(old: list[Any] | None, new: list[Any]) -> list[Any]:
    """Per layer, the new value where it has one, else the old (ranks measure different layers)."""
    if old is None:
        return new
    n = max(len(old), len(new))
    old, new = old + [None] * (n - len(old)), new + [None] * (n - len(new))
    return [b if b is not None else a for a, b in zip(old, new, strict=True)]
