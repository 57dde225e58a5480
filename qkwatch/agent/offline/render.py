"""Output of ``qkwatch analyze``: a rich table, JSON in the format of docs/metrics.md, or CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from qkwatch.agent.offline.analyze import Analysis, random_baseline
from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, as_text
from qkwatch.contract.values import encode_value

if TYPE_CHECKING:  # rich loads only when a table is drawn
    from rich.console import RenderableType
    from rich.table import Table

HEADERS = {
    "qkai": "qkai",
    "qkai_max": "max",
    "stable_rank": "srank",
    "qk_cos": "qk_cos",
    "wq_fro": "|Wq|F",
    "wk_fro": "|Wk|F",
    "wq_spec": "|Wq|2",
    "wk_spec": "|Wk|2",
    "wk_erank": "erank Wk",
}


def to_json(analysis: Analysis) -> str:
    shape = asdict(analysis.shape)
    layers = []
    for i, row in enumerate(analysis.layers):
        entry: dict[str, Any] = {"layer": row["layer"], **{k: encode_value(v) for k, v in row.items() if k != "layer"}}
        if analysis.heads is not None:
            entry["heads"] = {k: [encode_value(v) for v in vals] for k, vals in analysis.heads[i].items()}
        layers.append(entry)
    doc = {"model": analysis.model, "layout": analysis.layout, **shape, "rank": analysis.rank, "layers": layers}
    return json.dumps(doc, allow_nan=False)


def to_csv(analysis: Analysis) -> str:
    out = io.StringIO()
    metrics = [k for k in analysis.layers[0] if k != "layer"] if analysis.layers else []
    head_cols = []
    if analysis.heads:
        head_cols = [f"{m}_h{h}" for m in analysis.heads[0] for h in range(analysis.shape.n_heads)]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["layer", *metrics, *head_cols])
    for i, row in enumerate(analysis.layers):
        cells = [row["layer"], *(_fmt_csv(row[m]) for m in metrics)]
        if analysis.heads:
            cells += [_fmt_csv(v) for vals in analysis.heads[i].values() for v in vals]
        writer.writerow(cells)
    return out.getvalue()


def to_table(analysis: Analysis, threshold: float = COLLAPSE_THRESHOLD) -> RenderableType:
    """A rich renderable: one row per layer, QKAI above the collapse ``threshold`` in red."""
    from rich.table import Table

    s = analysis.shape
    gqa = f", {s.n_kv_heads} kv heads" if s.n_kv_heads != s.n_heads else ""
    table = Table(
        box=None,
        header_style="bold",
        pad_edge=False,
        title=f"{analysis.model} ({analysis.layout}): {s.n_layers} layers, {s.n_heads} heads{gqa}, "
        f"d_model {s.d_model}, d_head {s.d_head}, r = {analysis.rank}",
        caption=f"random subspaces give QKAI = r/d_model = {random_baseline(analysis):.4f}; "
        f"red: QKAI > {as_text(threshold)}",
    )
    metrics = [k for k in analysis.layers[0] if k != "layer"] if analysis.layers else []
    table.add_column("layer", justify="right")
    for m in metrics:
        table.add_column(HEADERS.get(m, m), justify="right", no_wrap=True)
    for row in analysis.layers:
        table.add_row(str(row["layer"]), *(_fmt_cell(m, row[m], threshold) for m in metrics))
    if not analysis.heads:
        return table
    from rich.console import Group

    return Group(table, "", heads_table(analysis, threshold))


def heads_table(analysis: Analysis, threshold: float = COLLAPSE_THRESHOLD) -> Table:
    """QKAI per head: values for up to 16 heads, one block character per head beyond."""
    from rich.table import Table

    n = analysis.shape.n_heads
    table = Table(box=None, header_style="bold", pad_edge=False, title="QKAI per head")
    table.add_column("layer", justify="right")
    if n <= 16:
        for h in range(n):
            table.add_column(f"h{h}", justify="right", no_wrap=True)
        for row, heads in zip(analysis.layers, analysis.heads or [], strict=True):
            table.add_row(str(row["layer"]), *(_fmt_cell("qkai", v, threshold, digits=2) for v in heads["qkai"]))
    else:
        table.add_column(f"heads 0..{n - 1} (block height = QKAI)", no_wrap=True)
        for row, heads in zip(analysis.layers, analysis.heads or [], strict=True):
            table.add_row(str(row["layer"]), "".join(_block(v, threshold) for v in heads["qkai"]))
    return table


def _block(value: float, threshold: float) -> str:
    if not math.isfinite(value):
        return "?"
    char = BLOCKS[min(len(BLOCKS) - 1, max(0, int(value * len(BLOCKS))))]
    return f"[red]{char}[/]" if value > threshold else char


BLOCKS = "▁▂▃▄▅▆▇█"


def band(analysis: Analysis, threshold: float = COLLAPSE_THRESHOLD) -> list[int]:
    """Layers whose mean QKAI exceeds the collapse threshold."""
    return [int(row["layer"]) for row in analysis.layers if row["qkai"] > threshold]  # the index, an int


def _fmt_cell(metric: str, value: float, threshold: float, digits: int = 3) -> str:
    text = _fmt_csv(value) if not math.isfinite(value) else f"{value:.{digits}f}" if abs(value) < 10 else f"{value:.1f}"
    if metric in ("qkai", "qkai_max") and math.isfinite(value) and value > threshold:
        return f"[bold red]{text}[/]"
    return text


def _fmt_csv(value: float) -> str:
    encoded = encode_value(value)
    return encoded if isinstance(encoded, str) else repr(float(value))  # finite: encoded is value
