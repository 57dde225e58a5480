"""The plain-text tables of the collector's commands (``token list``, ``runs list``, ``alerts``)."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: a header row, then one line per row, columns aligned two spaces apart.

    Plain text so that it greps, pipes and pastes; ``--json`` is the form for programs. The last
    column is not padded (a long summary does not drag trailing blanks along).
    """
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths, strict=False)) + "  " + line[-1]
        if len(line) > 1
        else line[0]
        for line in [headers, *rows]
    )
