"""The trainer's command line: ``qkwatch train``, ``qkwatch eval`` and ``python -m qkwatch.trainer``.

    python -m qkwatch.trainer --recipe debug_cpu [--set key=value ...] [--out DIR] [--resume]
    torchrun --nproc_per_node 2 -m qkwatch.trainer --recipe debug_cpu ...      # FSDP2, one process per rank

Only argparse at import time (``qkwatch --help`` stays fast): torch loads in the handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkwatch.trainer.run.config import RunConfig

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a GPT recipe (one process; use torchrun -m qkwatch.trainer for several)",
        description="Train a recipe. For several processes: torchrun --nproc_per_node N -m qkwatch.trainer "
        "--recipe NAME [...]. The agent is attached when QKWATCH_URL (or --collector) is set.",
    )
    add_train_arguments(train, verbose=False)
    train.set_defaults(handler=train_command)

    ev = subparsers.add_parser(
        "eval",
        help="passkey / variable binding / perplexity of a checkpoint",
        description="Evaluate a model.pt export, a run folder or a DCP checkpoint folder.",
    )
    ev.add_argument("checkpoint", help="model.pt, a run folder (runs/NAME) or a checkpoints/step-N folder")
    ev.add_argument(
        "--task",
        action="append",
        choices=["passkey", "binding", "perplexity", "all"],
        help="task to run; repeat for several (default: all)",
    )
    ev.add_argument("--lengths", help="comma-separated context lengths (default: fractions of the model's context)")
    ev.add_argument("--samples", type=int, default=50, help="queries per task and length (windows for perplexity)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the synthetic tasks")
    ev.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ev.add_argument("--collector", help="collector URL (sets QKWATCH_URL): results go to the checkpoint's run")
    ev.add_argument("--json", action="store_true", help="print the results as JSON")
    ev.set_defaults(handler=_eval)


def add_train_arguments(parser: argparse.ArgumentParser, verbose: bool = True) -> None:
    parser.add_argument("--recipe", default="debug_cpu", help="recipe name (see --list); default debug_cpu")
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config field by dotted key, e.g. model.n_layers=6 (repeatable)",
    )
    parser.add_argument("--out", help="run folder (default runs/RECIPE)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--collector", help="collector URL for the agent (sets QKWATCH_URL)")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    if verbose:
        parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def main(argv: list[str] | None = None) -> int:
    """``python -m qkwatch.trainer`` (and ``torchrun ... -m qkwatch.trainer``).

    Logging is set up per rank, then :func:`train_command` runs.
    """
    parser = argparse.ArgumentParser(prog="python -m qkwatch.trainer", description="Train a qkwatch GPT recipe.")
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    if rank != "0":  # one voice per job: other ranks only warn
        logging.getLogger().setLevel(logging.WARNING)
    if not args.verbose:  # the agent's httpx logs every request at INFO
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return train_command(args)


def train_command(args: argparse.Namespace) -> int:
    """``qkwatch train`` / ``python -m qkwatch.trainer``: 0 on success, 2 on a bad config."""
    if args.list:
        print_recipes()
        return 0
    try:
        cfg = resolve_config(args.recipe, args.set or [])
    except ValueError as exc:
        print(f"qkwatch train: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    if args.collector:
        os.environ["QKWATCH_URL"] = args.collector
    from qkwatch.trainer.run.train import run

    out = Path(args.out or Path("runs") / cfg.recipe)
    try:
        result = run(cfg, out, resume=args.resume)
    except ValueError as exc:
        from qkwatch.trainer.checkpoints.safety import BadCheckpoint

        # every rank finds the same fault in a checkpoint (the ranks check it together): rank 0 says it
        if not isinstance(exc, BadCheckpoint) or os.environ.get("RANK", "0") == "0":
            print(f"qkwatch train: {exc}", file=sys.stderr)
        return 2
    logger.info(
        "done: %d steps, loss %.4f, val_loss %s, run %s, out %s",
        result.steps,
        result.loss,
        f"{result.val_loss:.4f}" if result.val_loss is not None else "-",
        result.run_name,
        result.out_dir,
    )
    return 0


def resolve_config(recipe: str, overrides: list[str]) -> RunConfig:
    """The recipe's :class:`~qkwatch.trainer.run.config.RunConfig`, ``key=value`` overrides applied and validated."""
    from qkwatch.trainer.run import recipes
    from qkwatch.trainer.run.config import apply_overrides

    return apply_overrides(recipes.get(recipe), overrides)


def print_recipes() -> None:
    """The recipes as a table: a header row, then one recipe per line."""
    from qkwatch.trainer.run import recipes

    print(f"{'recipe':24s} {'layers':>6s} {'d_model':>7s} {'params':>10s}")
    for name, fn in recipes.RECIPES.items():
        cfg = fn()
        params = f"{cfg.model_config().num_params() / 1e6:,.1f}M"
        print(f"{name:24s} {cfg.model.n_layers:>6d} {cfg.model.d_model:>7d} {params:>10s}")


def _eval(args: argparse.Namespace) -> int:
    import torch

    from qkwatch.trainer.reporting.monitoring import open_monitor
    from qkwatch.trainer.run.evals import TASK_NAMES, evaluate, format_table, load_checkpoint

    tasks = list(TASK_NAMES) if not args.task or "all" in args.task else list(dict.fromkeys(args.task))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
        if args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        loaded = load_checkpoint(args.checkpoint, device)
        results = evaluate(loaded, tasks, lengths, args.samples, args.seed)
    except ValueError as exc:
        print(f"qkwatch eval: {exc}", file=sys.stderr)
        return 2
    if args.collector:
        os.environ["QKWATCH_URL"] = args.collector
    # The run's own config goes with the results: an attach resumes the run, and the config it sends
    # replaces the stored one, so anything else would overwrite the training's (its schedule included).
    monitor = open_monitor(loaded.model, config=loaded.config, run=loaded.run, project=loaded.project)
    try:
        monitor.log(loaded.step or 0, **{r.name: r.value for r in results})
    finally:
        monitor.close(10.0)
    if args.json:
        print(
            json.dumps(
                {"checkpoint": str(args.checkpoint), "step": loaded.step, "results": [r.__dict__ for r in results]},
                indent=2,
            )
        )
    else:
        print(format_table(results))
    return 0
