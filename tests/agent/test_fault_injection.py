"""The fault-injection suite: every fault the training run was found to meet, one training loop, one set of promises.

Each case trains a tiny model (12 steps; a report, a loss and a lambdas read every step) with the
agent attached while one fault is injected, and then checks the promises of ``docs/reliability.md``:

1. the loop finishes every step (a stall fails the case after 90 s);
2. every loss is finite, and every lambda in [0, lambda_max];
3. the process grows by less than 64 MB over its start (measured in a process that has trained
   before, sampled every 10 ms);
4. nothing is lost: every step's report was acknowledged (in a request the collector answered with
   the contract's ``{"inserted": n, "duplicates": m}``), or is still in the spool, pending or a
   dead letter, for a later sync or ``qkwatch spool resend``;
5. no warning is given twice, the fault is named in one, and the token is never shown.

The collector's faults (``faults.EVERY_ROUTE``: endless, trickled, 50 MB, 307, HTML 500 and 200,
JSON of the wrong shape, a 400-digit version, a 400 quoting the token) are served by ``Hostile``,
a real server on a loopback port, on every route at once: on every request, and on every other
request (then retries meet healthy answers, and reports must get through). The disk's faults run
against a healthy ``Hostile``, where every report must be acknowledged by the end: a real tmpfs
that fills, a tmpfs turned read-only, a spool root that is a file, and, injected through the spool
module's ``os.write`` (the kernel gives no way to ask for them), ENOSPC from a step on and short
writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.agent.faults import (
    EVERY_ROUTE,
    Answer,
    FaultyOs,
    Hostile,
    Memory,
    Run,
    assert_healthy_run,
    finish,
    kept,
    let_go,
    mount_tmpfs,
    qkwatch_warnings,
)

STEPS = 12
Hooks = dict[int, Callable[[], object]]


@dataclass(frozen=True)
class Disk:
    """A disk fault: where the spool goes (under the test's folder) and what happens before which step."""

    spool: Callable[[Path, contextlib.ExitStack], Path]
    at_step: Callable[[FaultyOs, Path], Hooks] = field(default=lambda fos, spool: {})
    injected: bool = False
    """Whether it needs ``faulty_os`` (the spool module's ``os.write`` replaced)."""


def _tmpfs(root: Path, stack: contextlib.ExitStack, size: str = "256k") -> Path:
    mount = root / "disk"
    mount_tmpfs(mount, size)
    stack.callback(subprocess.run, ["umount", "-l", str(mount)], check=False)
    return mount


def _read_only(root: Path, stack: contextlib.ExitStack) -> Path:
    mount = _tmpfs(root, stack)
    (mount / "spool").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    return mount / "spool"


def _a_file(root: Path, stack: contextlib.ExitStack) -> Path:
    (root / "spool").write_text("not a folder")
    return root / "spool"


def _fill(spool: Path) -> Hooks:
    """Before step 2: a file takes all but 8 KiB of the tmpfs (a report or two), and keeps it."""

    def fill() -> None:
        disk = spool.parent
        free = _free(disk)
        (disk / "filler").write_bytes(b"\0" * max(0, free - 8 * 1024))

    return {2: fill}


def _free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _on(fos: FaultyOs, **at: int) -> Hooks:
    """``{attribute: step}``: from that step on, ``fos.<attribute>`` is True."""
    return {step: (lambda name=name: setattr(fos, name, True)) for name, step in at.items()}


DISK: dict[str, tuple[Disk, str | None]] = {
    # fault: (how it is made, what its one warning says; None: nothing to say, the writes are finished)
    "a full disk (tmpfs)": (
        Disk(lambda root, stack: _tmpfs(root, stack) / "spool", lambda fos, s: _fill(s)),
        "the disk refused",
    ),
    "a read-only disk (tmpfs)": (Disk(_read_only), "cannot be used"),
    "a spool root that is a file": (Disk(_a_file), "cannot be used"),
    "ENOSPC from step 4": (
        Disk(lambda root, _: root / "spool", lambda fos, _: _on(fos, full=4), True),
        "the disk refused",
    ),
    "short writes": (Disk(lambda root, _: root / "spool", lambda fos, _: _on(fos, short=0), True), None),
    "short writes, then ENOSPC": (
        Disk(lambda root, _: root / "spool", lambda fos, _: _on(fos, short=0, full=6), True),
        "the disk refused",
    ),
}

CASES = [pytest.param(name, False, id=f"{name}, always") for name in EVERY_ROUTE]
CASES += [pytest.param(name, True, id=f"{name}, every other") for name in EVERY_ROUTE]


@pytest.fixture(scope="module", autouse=True)
def warmed_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One healthy run first, so that memory is measured against a process that has trained before
    (torch's first forward and backward allocate for good)."""
    server = Hostile()
    try:
        Run(server.url, tmp_path_factory.mktemp("warm-up") / "spool", steps=STEPS)()
    finally:
        server.close()


def assert_nothing_lost(server: Hostile, run: Run) -> set[int]:
    """Every step's report acknowledged or kept; the steps acknowledged."""
    let_go(run)
    spool = run.spool
    acknowledged = {r["step"] for r in server.acknowledged}
    held = {r["step"] for r in kept(spool)}
    lost = set(range(STEPS)) - acknowledged - held
    assert not lost, f"reports of steps {sorted(lost)} were neither acknowledged nor kept"
    return acknowledged


@pytest.mark.parametrize(("name", "every_other"), CASES)
def test_every_answer_on_every_route(
    name: str, every_other: bool, hostile: Callable[..., Hostile], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before issue 42's fixes: the wrong shapes raised out of attach(); endless and 50 MB answers
    were read whole; a trickle held attach() for tens of seconds; 307 sent reports to the dead
    letters and 500 was said only at DEBUG; a 200 of ``{}`` took reports out of the spool unstored."""
    caplog.set_level(logging.DEBUG)
    answer: Answer
    answer, said = EVERY_ROUTE[name]
    server = hostile(every_other, runs=answer, lambdas=answer, reports=answer, status=answer)
    memory = Memory()
    spool = tmp_path / "spool"
    runner = Run(server.url, spool, steps=STEPS)
    run = finish(lambda: runner(close_timeout=10.0 if every_other else 1.0))  # time for two trickles' deadlines
    assert_healthy_run(run, memory, caplog)
    assert any(said in w for w in qkwatch_warnings(caplog)), qkwatch_warnings(caplog)
    acknowledged = assert_nothing_lost(server, run)
    if every_other:
        assert acknowledged, "a collector that answers well every other time took no report"


@pytest.mark.parametrize("name", list(DISK))
def test_every_disk_fault(
    name: str,
    hostile: Callable[..., Hostile],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """Before issue 42's fixes: ENOSPC came out of step() (the trainer died), a short write lost a
    report without a word, and a read-only spool made attach() raise."""
    caplog.set_level(logging.DEBUG)
    disk, said = DISK[name]
    fos: FaultyOs = request.getfixturevalue("faulty_os") if disk.injected else FaultyOs()
    server = hostile()
    with contextlib.ExitStack() as stack:
        spool = disk.spool(tmp_path, stack)
        memory = Memory()
        runner = Run(server.url, spool, steps=STEPS, at_step=disk.at_step(fos, spool))
        run = finish(lambda: runner(close_timeout=30.0))
        fos.full = fos.short = False
        assert_healthy_run(run, memory, caplog, warned_of=said is not None)
        if said is not None:
            assert any(said in w for w in qkwatch_warnings(caplog)), qkwatch_warnings(caplog)
        assert assert_nothing_lost(server, run) == set(range(STEPS))  # a healthy collector took every one
        assert run.agent is not None and run.agent.spool.dropped == 0
