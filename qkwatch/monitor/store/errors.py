"""The store's errors, which the API turns into 4xx answers."""

from __future__ import annotations


class NotFound(LookupError):
    """The run (or other object) does not exist."""


class Invalid(ValueError):
    """The request is well-formed but not acceptable; the message names the problem."""
