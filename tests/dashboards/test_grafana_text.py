"""Red team, Grafana (issue 34): what users type (run and project names, tags, notes) is shown by the
dashboards as text, never as markup or a link.

No Grafana server runs here; the check is on the committed dashboards themselves, which is where it
would go wrong: Grafana renders HTML and Markdown only in text panels and in data links, and builds
a link from a cell's value only where a field config asks for it. Neither dashboard has a text
panel or an HTML cell; the one data link (a run's name in the runs table, to its own dashboard) is a
path of this Grafana and puts only the run's id into it, which the collector made (32 hex digits),
never a name, tag or note a user typed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dashboards.test_grafana_sql import GRAFANA

BOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}[{i}]")


@pytest.mark.parametrize("board", BOARDS, ids=lambda p: p.name)
def test_no_panel_renders_user_text_as_markup_or_a_link(board) -> None:
    data = json.loads(board.read_text())
    panels = [n for _, n in walk(data) if isinstance(n, dict) and "type" in n and "gridPos" in n]
    assert panels, board
    assert [p["title"] for p in panels if p["type"] in ("text", "news", "dashlist")] == []
    urls = [n["url"] for _, n in walk(data) if isinstance(n, dict) and "url" in n and n["url"]]
    interpolated = [u for u in urls if "${" in u]
    assert all(u.startswith("/d/") for u in interpolated), interpolated  # a path of this Grafana, no scheme
    fields = {part for u in interpolated for part in u.split("${")[1:]}
    assert fields <= {"__data.fields.run_id}"}, fields  # only the collector's id, never a user's text
    html_cells = [n for _, n in walk(data) if isinstance(n, dict) and n.get("type") in ("json-view", "html")]
    assert html_cells == []
