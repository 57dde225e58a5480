"""docs/reproduction.md is what ``python -m experiments.report`` makes of the committed results.

The report is generated, never hand-edited: this holds the committed markdown equal to the
generator's output from ``experiments/results/*.json``, and every figure it embeds present as a PNG
(the PNG export itself needs Chromium and is exercised by ``python -m experiments.report``).
"""

from __future__ import annotations

import re
from pathlib import Path

from experiments import report

DOCS = Path(report.__file__).resolve().parent.parent / "docs"


def test_the_committed_report_is_the_generators_output(tmp_path: Path) -> None:
    report.build(tmp_path, png=False)
    generated = (tmp_path / "reproduction.md").read_text()
    committed = (DOCS / "reproduction.md").read_text()
    assert generated == committed, "docs/reproduction.md is stale: run python -m experiments.report"
    assert "not run yet" not in committed


def test_every_embedded_figure_is_committed_and_in_the_html(tmp_path: Path) -> None:
    committed = (DOCS / "reproduction.md").read_text()
    figures = re.findall(r"!\[[^\]]*\]\(reproduction/([\w-]+)\.png\)", committed)
    assert len(figures) >= 8, figures
    for name in figures:
        png = DOCS / "reproduction" / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    html = (DOCS / report.FIGURES_PAGE).read_text()
    assert all(f"id='{name}'" in html for name in figures)
