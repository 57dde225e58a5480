"""A forked child (a DataLoader worker) must leave its parent's agents alone.

Threads do not survive a fork and the spool belongs to the parent, so in the child every tracked
object is told, once, through its ``after_fork_in_child()``.
"""

from __future__ import annotations

import os
import weakref
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
