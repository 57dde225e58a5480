"""docs/supported.md names only tests that exist: every ``tests/....py::name`` it cites is a test
function defined in that file, and each row of its tables cites one (as docs/reliability.md)."""

from __future__ import annotations

from tests.test_reliability_doc import ROOT, missing_citations


def test_every_row_of_the_supported_setups_page_cites_a_test_that_exists() -> None:
    text = (ROOT / "docs" / "supported.md").read_text()
    assert text.count("tests/") >= 25
    assert missing_citations(text) == []
