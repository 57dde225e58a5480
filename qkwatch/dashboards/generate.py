"""Write every generated file of dashboards/: the Grafana dashboards and provisioning, and the Prometheus rules.

    python -m qkwatch.dashboards.generate            # from the repository root: rewrite the committed files
    python -m qkwatch.dashboards.generate --check    # exit 1 if a committed file is stale
    python -m qkwatch.dashboards.generate --collapse-threshold 0.65 --h-star 0.8 --out /srv/qkwatch/dashboards

The collapse threshold and H* come from the options, else ``QKWATCH_COLLAPSE_THRESHOLD`` and
``QKWATCH_H_STAR``, else the defaults of ``qkwatch.contract.thresholds``: give it the collector's
values, so that Prometheus and Grafana draw the line where the collector does. The committed files
hold the defaults; tests/dashboards/test_grafana_generator.py holds them equal to :func:`render`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.dashboards.grafana import boards
from qkwatch.dashboards.prometheus import alert_rules

HERE = Path(__file__).resolve().parent
"""dashboards/: where the committed files live, the default ``--out``."""


def render(thresholds: Thresholds) -> dict[str, str]:
    """Relative path (under dashboards/) -> the file's exact text, for every generated file."""
    files = {f"grafana/{rel}": text for rel, text in boards.render(thresholds).items()}
    files.update({f"prometheus/{rel}": text for rel, text in alert_rules.render(thresholds).items()})
    return files


def stale(files: dict[str, str], out: Path) -> list[str]:
    """The files that are missing under ``out`` or differ from ``files``."""
    return [rel for rel, text in files.items() if not (out / rel).is_file() or (out / rel).read_text() != text]


def write(files: dict[str, str], out: Path, rels: list[str]) -> None:
    for rel in rels:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(files[rel])


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Thresholds]:
    parser = argparse.ArgumentParser(prog="python -m qkwatch.dashboards.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the files under --out")
    parser.add_argument("--collapse-threshold", type=float, metavar="X", help="default: $QKWATCH_COLLAPSE_THRESHOLD")
    parser.add_argument("--h-star", type=float, metavar="Y", help="default: $QKWATCH_H_STAR")
    parser.add_argument("--out", type=Path, default=HERE, metavar="DIR", help="default: the dashboards/ folder")
    args = parser.parse_args(argv)
    try:
        return args, Thresholds.resolve(args.collapse_threshold, args.h_star)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    args, thresholds = parse(argv)
    files = render(thresholds)
    changed = stale(files, args.out)
    if not args.check:
        write(files, args.out, changed)
    print(f"collapse threshold {as_text(thresholds.collapse)}, h_star {as_text(thresholds.h_star)}")
    verb = "stale" if args.check else "written"
    print("\n".join(f"{verb}: {os.path.relpath(args.out / rel)}" for rel in changed) or "up to date")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
