"""``qkwatch train`` and ``qkwatch eval``. Only argparse at import time: torch loads in the handlers."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers) -> None:
    train = subparsers.add_parser(
        "train", help="train a GPT recipe (one process; use torchrun -m trainer.train for several)",
        description="Train a recipe. For several processes: torchrun --nproc_per_node N -m trainer.train "
                    "--recipe NAME [...]. The agent is attached when QKWATCH_URL (or --collector) is set.")
    add_train_arguments(train, verbose=False)
    train.set_defaults(handler=_train)

    ev = subparsers.add_parser("eval", help="passkey / variable binding / perplexity of a checkpoint",
                               description="Evaluate a model.pt export, a run folder or a DCP checkpoint folder.")
    ev.add_argument("checkpoint", help="model.pt, a run folder (runs/NAME) or a checkpoints/step-N folder")
    ev.add_argument("--task", action="append", choices=["passkey", "binding", "perplexity", "all"],
                    help="task to run; repeat for several (default: all)")
    ev.add_argument("--lengths", help="comma-separated context lengths (default: fractions of the model's context)")
    ev.add_argument("--samples", type=int, default=50, help="queries per task and length (windows for perplexity)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the synthetic tasks")
    ev.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ev.add_argument("--collector", help="collector URL (sets QKWATCH_URL): results go to the checkpoint's run")
    ev.add_argument("--json", action="store_true", help="print the results as JSON")
    ev.set_defaults(handler=_eval)


def add_train_arguments(parser: argparse.ArgumentParser, verbose: bool = True) -> None:
    parser.add_argument("--recipe", default="debug_cpu", help="recipe name (see --list); default debug_cpu")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field by dotted key, e.g. model.n_layers=6 (repeatable)")
    parser.add_argument("--out", help="run folder (default runs/RECIPE)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--collector", help="collector URL for the agent (sets QKWATCH_URL)")
    parser.add_argument("--list", action="store_true", help="list the recipes and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    if verbose:
        parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _train(args: argparse.Namespace) -> int:
    from trainer.train import train_command

    return train_command(args)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from trainer.evals import TASK_NAMES, evaluate, format_table, load_checkpoint
    from trainer.monitoring import open_monitor

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
    monitor = open_monitor(loaded.model, config={"eval": tasks, "checkpoint": str(args.checkpoint)},
                           run=loaded.run, project=loaded.project)
    try:
        monitor.log(loaded.step or 0, **{r.name: r.value for r in results})
    finally:
        monitor.close(10.0)
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "step": loaded.step,
                          "results": [r.__dict__ for r in results]}, indent=2))
    else:
        print(format_table(results))
    return 0
