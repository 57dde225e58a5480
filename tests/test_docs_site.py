"""The docs site's MkDocs hooks (``docs/hooks/``); ``make check`` builds the site itself, strictly."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[1]


def hook(name: str) -> ModuleType:
    """A hook module, loaded from its file as MkDocs loads it (docs/hooks is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_optional_page_joins_the_nav_once_it_exists(tmp_path: Path) -> None:
    optional_pages = hook("optional_pages")
    nav = [{"Home": "index.md"}, {"Papers": [{"Reproduction": "reproduction.md"}, {"Suite": "instability.md"}]}]
    assert optional_pages.prune(nav, tmp_path) == [
        {"Home": "index.md"},
        {"Papers": [{"Reproduction": "reproduction.md"}]},
    ]
    assert optional_pages.prune([{"Suite": "instability.md"}], tmp_path) == []  # an emptied section goes too
    (tmp_path / "instability.md").write_text("# Instability\n")
    assert optional_pages.prune(nav, tmp_path) == nav
    assert optional_pages.prune([{"Typo": "demp.md"}], tmp_path) == [{"Typo": "demp.md"}]  # MkDocs reports it


def pages(nav: list) -> set[str]:
    return {p for item in nav for v in item.values() for p in (pages(v) if isinstance(v, list) else {v})}


def test_the_sites_nav_names_every_optional_page() -> None:
    """An optional page the nav does not list would never join it: the hook's list and the nav agree."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert pages(config["nav"]) >= hook("optional_pages").OPTIONAL


def test_escaped_pipes_in_a_tables_code_spans_read_as_pipes() -> None:
    unescape = hook("table_pipes").unescape_table_code
    page = "| `a=x\\|y` | a \\| b |\n`x\\|y` outside a table\n"
    assert unescape(page) == "| `a=x|y` | a \\| b |\n`x\\|y` outside a table\n"
