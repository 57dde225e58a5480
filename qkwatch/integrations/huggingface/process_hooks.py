"""What closes a run the Trainer left open: an uncaught exception, or the process's exit.

The Trainer has no exception event, so while a run is open :class:`ProcessHooks` chains a
``sys.excepthook`` and registers an ``atexit`` handler (see :mod:`qkwatch.integrations.huggingface.callback`).
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)


class ProcessHooks:
    """While a run is open: an uncaught exception (``sys.excepthook``, chained) or the process's exit closes it."""

    def __init__(self, on_exception: Callable[[BaseException], None], on_exit: Callable[[], None]) -> None:
        self._on_exception = on_exception
        self._on_exit = on_exit
        self._previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any] = sys.excepthook
        self._armed = False

    def install(self) -> None:
        if self._armed:
            return
        self._armed = True
        self._previous = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    def remove(self) -> None:
        """Disarm; restore the previous hook unless another was chained on top of ours (ours then only passes on)."""
        if not self._armed:
            return
        self._armed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous
        atexit.unregister(self._at_exit)

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous = self._previous
        if self._armed:
            try:
                self._on_exception(exc)
            except Exception:  # the exception being reported matters more than ours
                logger.exception("qkwatch: could not close the run after an uncaught exception")
        previous(exc_type, exc, tb)

    def _at_exit(self) -> None:
        if self._armed:
            self._on_exit()
