"""A forked child (a DataLoader worker) must leave its parent's agents alone.

Threads do not survive a fork and the spool belongs to the parent, so in the child every tracked
object is told, once, through its ``after_fork_in_child()``; the spool's lock
(:class:`ProcessLock`) is not inherited.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from pathlib import Path
from typing import Protocol


class Forkable(Protocol):
    def after_fork_in_child(self) -> None: ...


_TRACKED: weakref.WeakSet[Forkable] = weakref.WeakSet()
_HOOKED: list[bool] = []


def track(obj: Forkable) -> None:
    """Call ``obj.after_fork_in_child()`` in any child this process forks while ``obj`` lives."""
    if not _HOOKED:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _HOOKED.append(True)
    _TRACKED.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_TRACKED):
        obj.after_fork_in_child()


class ProcessLock:
    """An exclusive ``flock`` on a file, held by this process alone.

    A forked child closes its copy of the descriptor at once (never unlocks it: the lock belongs to
    the open file, which the parent shares), so the lock dies with the process that took it: a
    DataLoader worker that outlives a trainer killed with SIGKILL does not keep it.
    """

    def __init__(self, path: Path):
        """Raises BlockingIOError if another process holds it, OSError if the file cannot be opened."""
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise
        track(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close; idempotent."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def after_fork_in_child(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
