"""``python -m experiments.report``: docs/reproduction.md from the experiments' results.

Reads ``experiments/results/<experiment>.json`` (written by ``python -m experiments.<experiment>``
from the collector's data), asks each experiment's section module
(``experiments.reproduction.<experiment>_section``) for its section, and writes

* ``docs/reproduction.md``: the sections, each figure embedded as a PNG;
* ``docs/reproduction/<figure>.png``: the figures, exported by kaleido through a headless Chromium
  (``BROWSER_PATH``, default ``/usr/bin/chromium``);
* ``docs/reproduction-figures.html``: every figure interactive in one self-contained page (plotly.js inline once).

An experiment without results is listed as not run, with its command.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from experiments.common import load, log

EXPERIMENTS = ("seed001", "seed003", "seed000", "qkai_scale")
"""In the report's order."""
COMMANDS = {
    "seed000": "python -m experiments.seed000 --seeds 0,1",
    "seed001": "python -m experiments.seed001 --steps 300 --seeds 37,42",
    "seed003": "python -m experiments.seed003",
    "qkai_scale": "python -m experiments.qkai_scale",
}
DOCS = Path(__file__).resolve().parent.parent / "docs"
FIGURES_PAGE = "reproduction-figures.html"
"""The interactive figures, beside reproduction.md (not ``reproduction.html``, which the docs site builds from it)."""

INTRO = """# The seeds, reproduced at CPU scale

The papers this project is built on make measurable claims. This page puts each next to what the
project measures at the scale of a 2-core CPU machine, through its own pieces: every training run
streams through the agent into a collector, and every table and figure of a training experiment is
made from what the project's Python client (`qkwatch.client.Client`) reads back from that
collector. The at-initialisation experiments (seed 003, QKAI's scale) train nothing: they call the
agent's metric functions (`qkwatch/agent/metrics`) directly on random weights and inputs.

For each claim: the paper's number, ours, the scale difference, and whether it carried over.
Negative results are reported as such. The interactive figures are in
[reproduction-figures.html](reproduction-figures.html). To regenerate everything (about two hours on 2 cores):

```
{commands}
python -m experiments.report
```

The code is `experiments/` (`common.py`: a collector, runs trained into it, reading them back).
"""


def build(docs: Path = DOCS, png: bool = True) -> Path:
    import plotly.io as pio

    sections, figures = [], []
    for name in EXPERIMENTS:
        results = load(name)
        if results is None:
            sections.append(f"## {name}: not run yet\n\n`{COMMANDS[name]}`\n")
            continue
        module = importlib.import_module(f"experiments.reproduction.{name}_section")
        text, figs = module.section(results)
        sections.append(text)
        figures += figs
    out_dir = docs / "reproduction"
    out_dir.mkdir(parents=True, exist_ok=True)
    if png:
        os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
        for fig_name, fig in figures:
            fig.write_image(out_dir / f"{fig_name}.png", scale=1)
            log(f"wrote {out_dir / fig_name}.png")
    divs = [
        f"<h2 id='{n}'>{n}</h2>" + pio.to_html(f, full_html=False, include_plotlyjs=(i == 0), div_id=f"fig-{n}")
        for i, (n, f) in enumerate(figures)
    ]
    html = (
        "<!doctype html><html><head><meta charset='utf-8'><title>qkwatch: the seeds reproduced</title>"
        "</head><body style='font-family: sans-serif'><h1>qkwatch: the seeds reproduced (figures)</h1>"
        "<p>See reproduction.md for the tables and what each figure shows.</p>" + "".join(divs) + "</body></html>"
    )
    (docs / FIGURES_PAGE).write_text(html)
    commands = "\n".join(COMMANDS[n] for n in EXPERIMENTS)
    md = INTRO.format(commands=commands) + "\n" + "\n".join(sections)
    path = docs / "reproduction.md"
    path.write_text(md)
    log(f"wrote {path} and {docs / FIGURES_PAGE} ({len(figures)} figures)")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=DOCS, help="where reproduction.md goes (default docs/)")
    p.add_argument("--no-png", action="store_true", help="skip the PNG export (no Chromium)")
    args = p.parse_args(argv)
    build(args.docs, png=not args.no_png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
