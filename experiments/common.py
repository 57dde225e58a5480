"""What every training experiment shares: a collector, runs streamed into it, and reading them back.

An experiment is a *campaign*: one collector (``qkwatch serve`` over SQLite under
``experiments/out/<campaign>/``), a list of :class:`RunSpec` trained as subprocesses (``python -m
trainer``, one CPU thread each, ``workers`` at a time) with the agent reporting to that collector,
then ``qkwatch eval`` on each finished run, whose results the collector also stores on the run. The
tables and figures are made from what the project's Python client (:class:`qkwatch.client.rest.Client`)
reads back, never from the trainers' own files: this is the system's longest end-to-end path.

A campaign resumes: a run the collector already holds as ``finished`` (with its evaluations) is not
trained again, so an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qkwatch.launch import CollectorProcess

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"
RESULTS = ROOT / "results"


@dataclass
class RunSpec:
    """One training run of a campaign."""

    name: str
    """The run's name in the collector (unique in the campaign)."""
    recipe: str
    sets: list[str] = field(default_factory=list)
    """``--set KEY=VALUE`` overrides of the recipe."""
    evals: list[tuple[str, str]] = field(default_factory=list)
    """``(task, lengths)`` pairs for ``qkwatch eval`` after training, e.g. ``("passkey", "128,256")``."""
    tags: dict[str, Any] = field(default_factory=dict)
    """What the analysis groups by (variant, seed, depth, ...); kept in the results."""


def one_blas_thread() -> contextlib.AbstractContextManager:
    """numpy's BLAS on one thread too (threadpoolctl where installed): on shared cores its spinning
    threads make a tall SVD 50x slower."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1)


def at_init_main(
    name: str, doc: str, run: Callable[..., dict], headlines: Callable[[dict], list[str]], argv: list[str] | None
) -> int:
    """The command line of an at-initialisation experiment: ``python -m experiments.<name> [--quick]``."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds (what the tests run)")
    args = p.parse_args(argv)
    results = run(quick=args.quick)
    path = save(name, results, strict=True)
    for line in headlines(results):
        print(line)
    print(f"wrote {path} ({results['wall_s']:.0f} s)")
    return 0


def at_init_run(name: str, quick: bool, cfg: dict, seed: int, parts: Callable[[dict, dict, Any], None]) -> dict:
    """An at-initialisation experiment run on one CPU thread (numpy's BLAS and torch), as plain JSON values.

    Its results begin with which experiment ran, its settings and seed, and the versions and threads it
    ran on; ``parts(results, cfg, generator)`` adds what it measures (the torch generator seeded with
    ``seed``); ``wall_s`` is the whole run's time.
    """
    import torch

    with one_blas_thread():
        torch.set_num_threads(1)
        started = time.time()
        results: dict[str, Any] = {
            "experiment": name,
            "quick": quick,
            "settings": cfg,
            "seed": seed,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        }
        parts(results, cfg, torch.Generator().manual_seed(seed))
        results["wall_s"] = time.time() - started
        return jsonable(results)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Campaign:
    """A collector under ``experiments/out/<name>`` and the runs trained into it."""

    def __init__(self, name: str, *, workers: int = 2, root: Path | None = None, samples: int = 40) -> None:
        self.name = name
        self.root = (root or OUT / name).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.samples = samples
        self.collector = CollectorProcess(f"sqlite:///{self.root / 'collector.db'}", log=self.root / "collector.log")

    def __enter__(self) -> Campaign:
        self.collector.start()
        self._client = self.collector.client(timeout=60.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()
        self.collector.stop()

    @property
    def client(self):
        return self._client

    # --- running ------------------------------------------------------------------------------------

    def run_id(self, name: str) -> str | None:
        found = self.client.runs(project=self.name, name=name)["data"]
        return found[0]["id"] if found else None

    def trained(self, spec: RunSpec) -> bool:
        return self.finished(spec.name)

    def finished(self, name: str) -> bool:
        """Whether the collector holds the run ``name`` finished."""
        run = self.run_id(name)
        return run is not None and self.client.run(run)["status"] == "finished"

    def evaluated(self, spec: RunSpec) -> bool:
        run = self.run_id(spec.name)
        if run is None:
            return False
        have = set(self.client.metrics(run).metrics)
        return all(any(m.startswith(_eval_prefix(task)) for m in have) for task, _ in spec.evals)

    def done(self, spec: RunSpec) -> bool:
        return self.trained(spec) and self.evaluated(spec)

    def run(self, specs: Sequence[RunSpec]) -> dict[str, str]:
        """Train and evaluate every spec the collector does not hold finished yet; name -> run id.

        A run the collector holds finished but without all of its evaluations is only evaluated.

        Raises:
            RuntimeError: naming the runs that failed, with their logs.
        """
        todo = [s for s in specs if not self.trained(s)]
        to_evaluate = [s for s in specs if s not in todo and not self.evaluated(s)]
        log(
            f"{self.name}: {len(specs) - len(todo)} of {len(specs)} runs already in the collector; "
            f"{len(todo)} to train, {self.workers} at a time, {len(to_evaluate)} to evaluate again "
            f"(logs in {self.root / 'logs'})"
        )
        failed = [s.name for s in to_evaluate if not self._evaluate(s)]
        pending, active = list(todo), []
        started = time.monotonic()
        while pending or active:
            while pending and len(active) < self.workers:
                spec = pending.pop(0)
                active.append((spec, self._start(spec)))
            time.sleep(1.0)
            for spec, proc in list(active):
                if proc.poll() is None:
                    continue
                active.remove((spec, proc))
                ok = proc.returncode == 0 and self._evaluate(spec)
                if not ok:
                    failed.append(spec.name)
                finished = len(todo) - len(pending) - len(active)
                log(
                    f"  {spec.name}: {'done' if ok else 'FAILED'} ({finished}/{len(todo)}, "
                    f"{(time.monotonic() - started) / 60:.1f} min)"
                )
        if failed:
            raise RuntimeError(f"{self.name}: runs failed: {', '.join(failed)}; see {self.root / 'logs'}")
        return {s.name: self.run_id(s.name) for s in specs}

    def _env(self, spec: RunSpec) -> dict[str, str]:
        return {
            **os.environ,
            "QKWATCH_URL": self.collector.url,
            "QKWATCH_PROJECT": self.name,
            "QKWATCH_RUN": spec.name,
            "QKWATCH_SPOOL": str(self.root / "spool"),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _start(self, spec: RunSpec) -> subprocess.Popen:
        (self.root / "logs").mkdir(exist_ok=True)
        out = self.root / "runs" / spec.name
        sets = [a for kv in ["parallel.cpu_threads=1", *spec.sets] for a in ("--set", kv)]
        cmd = [sys.executable, "-m", "qkwatch.trainer", "--recipe", spec.recipe, "--out", str(out), *sets]
        logfile = open(self.root / "logs" / f"{spec.name}.log", "w")  # noqa: SIM115 (the child owns it)
        return subprocess.Popen(cmd, env=self._env(spec), stdout=logfile, stderr=subprocess.STDOUT)

    def _evaluate(self, spec: RunSpec) -> bool:
        for task, lengths in spec.evals:
            cmd = [
                sys.executable,
                "-m",
                "qkwatch.cli",
                "eval",
                str(self.root / "runs" / spec.name),
                "--task",
                task,
                "--lengths",
                lengths,
                "--samples",
                str(self.samples),
                "--collector",
                self.collector.url,
            ]
            with open(self.root / "logs" / f"{spec.name}.log", "a") as logfile:
                if subprocess.run(cmd, env=self._env(spec), stdout=logfile, stderr=subprocess.STDOUT).returncode:
                    return False
        return True


def _eval_prefix(task: str) -> str:
    """The metric an evaluation leaves on its run (passkey: the digit accuracy, the newer of its two)."""
    return {"passkey": "passkey1_digits_", "binding": "binding_acc_", "perplexity": "ppl_"}[task]


# --- reading back ------------------------------------------------------------------------------------


def read_run(
    client, run: str, layer_metrics: Iterable[str]
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, tuple[list[int], list[float]]]]:
    """One run read back in one ``history`` call: ``(grids, scalars)``.

    ``grids``: ``metric -> (steps, values[step, layer])`` for those of ``layer_metrics`` the run
    reported; ``scalars``: every run-level scalar (loss, val_loss, evaluations, ...) as
    ``name -> (steps, values)``, the steps where it was measured.
    """
    have = client.metrics(run).metrics
    per_layer = [m for m in layer_metrics if m in have]
    run_level = [m for m, layers in have.items() if -1 in layers]
    frame = client.history(run, list(dict.fromkeys([*per_layer, *run_level])), frame=True)
    layers, rows = frame[frame["layer"] >= 0], frame[frame["layer"] == -1]
    grids = {}
    for metric in per_layer:
        table = layers.pivot_table(index="step", columns="layer", values=metric, aggfunc="last").sort_index()
        table = table.dropna(how="all")
        grids[metric] = (table.index.to_numpy(), table.to_numpy(dtype=float))
    scalars = {}
    for name in run_level:
        measured = rows[["step", name]].dropna()
        if len(measured):
            scalars[name] = (measured["step"].astype(int).tolist(), measured[name].astype(float).tolist())
    return grids, scalars


def last(series: tuple[list[int], list[float]] | None) -> float:
    if not series:
        return math.nan
    values = [v for v in series[1] if v is not None and math.isfinite(v)]
    return values[-1] if values else math.nan


def save(name: str, results: dict, *, strict: bool = False) -> Path:
    """Write ``experiments/results/<name>.json``; ``strict``: non-finite numbers become null (valid JSON)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    text = (
        json.dumps(jsonable(results), indent=1, sort_keys=True, allow_nan=False)
        if strict
        else json.dumps(results, indent=1, sort_keys=True, default=_plain)
    )
    path.write_text(text + "\n")
    return path


def save_json(data: Mapping[str, Any], path: Path) -> Path:
    """Write ``data`` to ``path`` as the committed results are: sorted keys, one space indents, finite numbers only."""
    path.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")
    return path


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def jsonable(x: Any) -> Any:
    """``x`` with numpy scalars and arrays as Python ones, tuples as lists, keys as strings, NaN and
    infinities as None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _plain(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON-able: {type(x).__name__}")


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def mean_sd(values: Iterable[float], spec: str = ".3f") -> str:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return "-"
    if len(v) == 1:
        return format(v[0], spec)
    return f"{format(float(np.mean(v)), spec)} ± {format(float(np.std(v, ddof=1)), spec)}"
