"""A suite file of training runs: grids and single runs read from YAML into :class:`SuiteRun` (pure).

``experiments/instability_sweep.yml`` (the tune recipe's learning-rate sweep) and
``experiments/heldout_sweep.yml`` (issue 40's held-out recipes) are such files: ``grids`` expand
variants x rates x seeds, ``runs`` list single runs; every run names its recipe, seed and split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments.common import RunSpec

SPLITS = ("tune", "test", "holdout")
"""tune: detectors are chosen on these; test: scored on these; holdout: scored once, at the end."""


@dataclass(frozen=True)
class SuiteRun:
    """One run of the suite, as the YAML file lists it (a grid expanded)."""

    name: str
    recipe: str
    seed: int
    split: str
    pressure: str
    variant: str = "vanilla"
    sets: tuple[str, ...] = ()
    induced: bool = False
    lr: float | None = None
    group: str = ""

    def spec(self) -> RunSpec:
        sets = [*self.sets, f"seed={self.seed}"]
        return RunSpec(self.name, self.recipe, sets, tags={"split": self.split, "variant": self.variant})


def load_runs(path: Path) -> list[SuiteRun]:
    """The runs of a suite file; ValueError names the entry and the key that is wrong."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    unknown = sorted(set(data) - {"grids", "runs"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r} (known: grids, runs)")
    runs = [r for g in data.get("grids") or [] for r in _expand(g)]
    for i, item in enumerate(data.get("runs") or []):
        runs.append(_run(item, f"runs[{i}]", group=item.get("pressure", "")))
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{path}: run name {dupes[0]!r} is used twice")
    return runs


def _expand(grid: dict[str, Any]) -> list[SuiteRun]:
    name = grid.get("name", "")
    out = []
    for (variant, sets), lr, (seed, split) in itertools.product(
        grid["variants"].items(), grid["lr"], grid["seeds"].items()
    ):
        item = {
            "name": name.format(variant=variant, lr=f"{lr:g}", seed=seed),
            "recipe": grid["recipe"],
            "seed": seed,
            "split": split,
            "pressure": grid.get("pressure", ""),
            "variant": variant,
            "induced": grid.get("induced", False),
            "sets": [*sets, f"optim.lr={lr!r}"],
            "lr": lr,
        }
        out.append(_run(item, f"grid {name!r}", group=grid.get("pressure", "")))
    return out


def _run(item: dict[str, Any], where: str, group: str) -> SuiteRun:
    known = {"name", "recipe", "seed", "split", "pressure", "variant", "sets", "induced", "lr"}
    unknown = sorted(set(item) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}")
    for key in ("name", "recipe", "seed", "split"):
        if key not in item:
            raise ValueError(f"{where}: {key} is required")
    if item["split"] not in SPLITS:
        raise ValueError(f"{where} ({item['name']}): split must be one of {', '.join(SPLITS)}, got {item['split']!r}")
    lr = item.get("lr")
    if lr is None:
        lr = next((float(s.split("=", 1)[1]) for s in item.get("sets", []) if s.startswith("optim.lr=")), None)
    return SuiteRun(
        name=str(item["name"]),
        recipe=str(item["recipe"]),
        seed=int(item["seed"]),
        split=str(item["split"]),
        pressure=str(item.get("pressure", "")),
        variant=str(item.get("variant", "vanilla")),
        sets=tuple(str(s) for s in item.get("sets", [])),
        induced=bool(item.get("induced", False)),
        lr=lr,
        group=group,
    )
