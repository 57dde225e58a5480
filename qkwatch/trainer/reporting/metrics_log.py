"""``<out>/metrics.jsonl``: the run's own log of what it measured, one JSON object per line.

Every record carries the ``step`` it belongs to (the training step records of ``train.log_every``,
the per-layer QKAI lines, the validation losses); a resume cuts the file back to the steps before
the checkpoint it continues from, so that a resumed run's file reads as one uninterrupted run.
Only rank 0 writes it (the caller decides).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records to a JSON-lines file; :meth:`truncate` keeps the records before a step.

    The file is opened for each record and closed again, so there is nothing to close and a
    crashed run loses at most the line it was writing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` (which has a ``"step"``) as one line."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate(self, step: int) -> None:
        """Keep only the records of steps before ``step`` (a resume from the checkpoint at ``step``)."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        self.path.write_text("".join(line + "\n" for line in kept))
