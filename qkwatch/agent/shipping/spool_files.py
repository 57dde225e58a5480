"""The spool's small files beside its segments: ``meta.json``, ``cursor.json`` and ``dead-letter.jsonl``.

``meta.json`` and ``cursor.json`` are written whole (a temporary file, then ``os.replace``), dead
letters appended one JSON line each; no error of theirs leaves the spool: the meta and the cursor
stay in memory, a refused dead letter is not kept, each said once. What is read back is checked,
with one warning: a file that is not a JSON object is ignored, a ``meta.json`` field of the wrong
type left out (``contract.spool_format.clean_meta``), a damaged cursor read as 0 (``cursor_of``).
The spool then checks the cursor against the records on disk (``checked_cursor``: one that points
past them reads as "nothing delivered yet"; the collector stores a re-sent report once).

:class:`SpoolFiles` is the part of :class:`qkwatch.agent.shipping.disk_spool.Spool` that does this;
the spool's constructor sets the state it uses.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from qkwatch.agent.shipping.forks import ProcessLock
from qkwatch.contract.spool_format import Position, clean_meta, cursor_of

logger = logging.getLogger(__name__)


class SpoolFiles:
    """Reads and writes the spool's metadata and dead letters (a base of ``Spool``)."""

    # set by Spool.__init__
    path: Path
    dropped: int
    _cursor: Position
    _owner: ProcessLock | None
    _closed: bool
    _warned: set[str]
    _meta: dict[str, Any] | None

    def read_meta(self) -> dict[str, Any]:
        """``meta.json`` (fields of the wrong type left out, with a warning), or the last meta written."""
        if self._meta is not None:
            return dict(self._meta)
        value = self._read_json("meta.json")
        if value is None:
            return {}
        meta, wrong = clean_meta(value)
        if wrong:
            self._warn_once("meta", "spool %s: ignoring meta.json fields of the wrong type: %s", self.path, wrong)
        return meta

    def write_meta(self, meta: dict[str, Any]) -> None:
        self._meta = dict(meta)
        if not self._usable:
            return
        try:
            _write_json_atomic(self.path / "meta.json", meta)
        except OSError as exc:
            self._warn_once("meta-write", "spool %s: could not write meta.json (%s); kept in memory", self.path, exc)

    def _load_cursor(self) -> tuple[Position, int]:
        """``cursor.json``'s position and dropped count; a damaged one reads as 0, with a warning."""
        state = self._read_json("cursor.json")
        cursor, dropped = cursor_of(state) if state is not None else (Position(0, 0), 0)
        if cursor is None or dropped is None:
            self._warn_once("cursor", "spool %s: cursor.json is damaged (%s); reading it as 0", self.path, state)
        return cursor or Position(0, 0), dropped or 0

    def _save_cursor(self) -> None:
        if not self._usable:
            return
        try:
            _write_json_atomic(self.path / "cursor.json", {**self._cursor.as_dict(), "dropped": self.dropped})
        except OSError as exc:  # kept in memory; a restart may re-send what was delivered, stored once
            self._warn_once("cursor-write", "spool %s: could not save cursor.json (%s)", self.path, exc)

    def dead_letter(self, entry: dict[str, Any]) -> None:
        if not self._usable:
            self._warn_once("dead-letter", "spool %s: refused reports are not kept (no spool on disk)", self.path)
            return
        try:
            with open(self.path / "dead-letter.jsonl", "a") as fh:
                fh.write(json.dumps(entry, allow_nan=False) + "\n")
        except OSError as exc:
            self._warn_once(
                "dead-letter",
                "spool %s: could not write dead-letter.jsonl (%s); refused reports are not kept",
                self.path,
                exc,
            )

    def _read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON object of the spool's; None (with a warning) if it is missing, unreadable or not an object."""
        try:
            value = json.loads((self.path / name).read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as exc:
            self._warn_once(name, "spool %s: ignoring %s: %s", self.path, name, exc)
            return None
        if not isinstance(value, dict):
            self._warn_once(name, "spool %s: ignoring %s: not a JSON object", self.path, name)
            return None
        return value

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    @property
    def _usable(self) -> bool:
        """Whether this process owns the spool on disk (False: it works from memory alone, or is closed)."""
        return self._owner is not None and self._owner.held and not self._closed


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, allow_nan=False))
    os.replace(tmp, path)
