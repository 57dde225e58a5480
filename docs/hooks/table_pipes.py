"""MkDocs hook: ``\\|`` inside a code span of a table row reads ``|`` on the site, as it does on GitHub.

GitHub splits table cells at every unescaped ``|``, code spans included, so the pages write
``\\|`` there (``?format=csv\\|jsonl``). Python-Markdown does not split inside code spans and keeps
the backslash, so without this the site would show ``csv\\|jsonl``.
"""

from __future__ import annotations

import re
from typing import Any

CODE_SPAN = re.compile(r"`[^`\n]*`")


def unescape_table_code(markdown: str) -> str:
    """Each table row's code spans with ``\\|`` turned into ``|``; every other line as it is."""
    return "\n".join(
        CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line) if line.lstrip().startswith("|") else line
        for line in markdown.split("\n")
    )


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return unescape_table_code(markdown)
