"""Where qkwatch's Grafana panels go: a :class:`Layout` places them on Grafana's 24-column grid and numbers them."""

from __future__ import annotations

from typing import Any


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new line."""

    def __init__(self) -> None:
        self.x = self.y = self.line = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.line = 0, self.y + self.line, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.line = max(self.line, h)
        return pos

    def row(self, title: str) -> dict[str, Any]:
        if self.x:
            self.x, self.y, self.line = 0, self.y + self.line, 0
        panel = {
            "type": "row",
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            "id": self.take_id(),
            "panels": [],
        }
        self.y += 1
        return panel

    def take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1
