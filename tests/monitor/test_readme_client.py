"""The Python client example of the README and of docs/collector.md, run exactly as written against a
real ``qkwatch serve`` (SQLite and PostgreSQL): its per-layer DataFrame is steps x layers, with no column
for layer -1 (where the run-level scalars live) and no step at which QKAI was not measured."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live import ROOT, LiveCollector
from tests.monitor.conftest import report

PAGES = [ROOT / "README.md", ROOT / "docs" / "collector.md"]
N_LAYERS = 4
QKAI_STEPS = [0, 10, 20, 30]


def python_block(page: Path, marker: str) -> str:
    """The page's one ```python block that contains ``marker``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of {page.name} contain {marker!r}"
    return blocks[0]


def qkai(step: int) -> list[float]:
    """Layer 3 collapses (0.75 -> 0.90), the others stay low."""
    return [0.2 + 0.01 * layer if layer < 3 else 0.75 + 0.005 * step for layer in range(N_LAYERS)]


@pytest.fixture
def served(isolated_db_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A live collector holding ``demo/vanilla``: QKAI every 10 steps, the stable rank at steps of its own
    (one, 25, where QKAI was not measured), the loss every 5 steps; QKWATCH_URL points at it."""
    with LiveCollector(tmp_path, None, "--database-url", isolated_db_url) as live:
        client = live.client()
        run = client.create_run("demo", "vanilla", {"n_layers": N_LAYERS})
        reports = [report(s, {"qkai": qkai(s)}) for s in QKAI_STEPS]
        reports += [report(s, {"stable_rank": [2.0] * N_LAYERS}) for s in (0, 20, 25)]
        reports += [report(s, scalars={"loss": 3.0 - 0.01 * s}) for s in range(0, 40, 5)]
        client.send_reports(run["id"], sorted(reports, key=lambda r: r["step"]))
        monkeypatch.setenv("QKWATCH_URL", live.url)
        monkeypatch.delenv("QKWATCH_TOKEN", raising=False)
        yield run["id"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_dataframe_example_gives_steps_by_layers(served: str, page: Path) -> None:
    pytest.importorskip("pandas")
    names: dict = {}
    exec(python_block(page, "c.history("), names)  # the page's own code, as a user pastes it
    grid = names["qkai"]
    assert grid.shape == (len(QKAI_STEPS), N_LAYERS)
    assert list(grid.columns) == list(range(N_LAYERS)) and -1 not in grid.columns
    assert list(grid.index) == QKAI_STEPS  # step 25 (only the stable rank) is not a row of NaN
    assert grid.notna().all().all()
    assert grid.loc[30, 3] == pytest.approx(0.9) and grid.loc[0, 0] == pytest.approx(0.2)
    assert list(names["loss"].index) == list(range(0, 40, 5))
    assert names["run"].id == served and [r.id for r in names["hot"]] == [served]
    assert {a.rule for a in names["still_open"]} == {"qkai_high"}
