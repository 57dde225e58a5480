"""The checks the agent's config dataclasses run in ``__post_init__``; each failure names its setting.

A :class:`SettingError` carries the setting's name, so :meth:`qkwatch.agent.config.AgentConfig.resolve`
can add the environment variable a bad value came from.
"""

from __future__ import annotations

import math
from typing import Any


class SettingError(ValueError):
    """A setting with a bad value; the message starts with the setting's name."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def positive_ints(config: Any, *keys: str) -> None:
    """Each of ``keys`` is an integer >= 1."""
    for key in keys:
        value = getattr(config, key)
        if not isinstance(value, int) or value < 1:
            raise SettingError(key, f"{key} must be a positive integer, got {value!r}")


def cadences(config: Any, *keys: str) -> None:
    """Each of ``keys`` is None (a derived default) or an integer >= 0 (0 = never)."""
    for key in keys:
        value = getattr(config, key)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise SettingError(key, f"{key} must be an integer >= 0 (0 = never), got {value!r}")


def positive_seconds(config: Any, *keys: str) -> None:
    """Each of ``keys`` is a finite number > 0."""
    for key in keys:
        value = getattr(config, key)
        if not isinstance(value, (int, float)) or not _finite(value) or value <= 0:
            shown = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else repr(value)
            raise SettingError(key, f"{key} must be a positive number of seconds, got {shown}")


def _finite(value: float) -> bool:
    """math.isfinite that says False (not OverflowError) for an integer too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
