"""Preemption: a SIGTERM (a cluster's notice) remembered until the loop can checkpoint and stop."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Preemption:
    """Remembers a SIGTERM (a cluster's preemption notice) instead of dying at once; ``close`` restores.

    The loop reads ``requested`` at its log steps, where the ranks already synchronise, so they
    all stop after the same step, with a checkpoint (``--resume`` continues).
    """

    def __init__(self, install: bool = True) -> None:
        self.requested = False
        self._previous = None
        if install and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
