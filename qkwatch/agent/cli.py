"""The agent's subcommands: ``qkwatch analyze``, ``qkwatch sync`` and ``qkwatch spool resend``. Imports
only argparse and the (stdlib-only) thresholds at the top."""

from __future__ import annotations

import argparse
import sys

from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, ENV, Thresholds, as_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "analyze",
        help="per-layer query-key geometry of a checkpoint file or a HuggingFace model folder",
        description="Reads the query and key projections of every layer (lazily, a chunk of layers at a "
        "time) and prints QKAI, its per-head max, the stable rank of Wq Wk^T, qk_cos and the projection "
        "norms. Knows BERT, GPT-2, Llama/Mistral/Qwen (GQA), nanoGPT and qkwatch's own GPT.",
    )
    p.add_argument("path", help="model folder (config.json + weights) or checkpoint file")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (the format of docs/metrics.md)")
    fmt.add_argument("--csv", action="store_true", help="CSV, one row per layer")
    p.add_argument("--heads", action="store_true", help="add per-head values")
    p.add_argument("--rank", type=int, default=None, metavar="R", help="r for QKAI (default d_head)")
    p.add_argument("--no-spectra", action="store_true", help="skip the projection SVDs (norms, wk_erank)")
    p.add_argument(
        "--collapse-threshold",
        type=float,
        default=None,
        metavar="X",
        help=f"QKAI shown red above this (default: ${ENV['collapse']}, else {as_text(COLLAPSE_THRESHOLD)})",
    )
    m = p.add_argument_group("mapping, for checkpoints no layout knows ({i} = layer index)")
    m.add_argument("--q-key", metavar="PATTERN", help="query weight key, e.g. 'blocks.{i}.attn.wq.weight'")
    m.add_argument("--k-key", metavar="PATTERN", help="key weight key")
    m.add_argument("--qkv-key", metavar="PATTERN", help="fused QKV weight key")
    m.add_argument(
        "--split",
        choices=("qkv", "per_head", "per_kv_head"),
        help="row order of the fused QKV weight: [q; k; v] (nanoGPT, GPT-2), per_head (GPT-NeoX), "
        "per_kv_head (Megatron)",
    )
    m.add_argument("--conv1d", action="store_true", help="the fused weight is stored (d_model, 3*d_model)")
    m.add_argument("--n-heads", type=int, help="number of query heads")
    m.add_argument("--n-kv-heads", type=int, help="number of key/value heads (GQA)")
    p.set_defaults(handler=run_analyze)

    s = sub.add_parser(
        "sync",
        help="deliver what an agent spooled while the collector was away (exactly once, however often it runs)",
    )
    _delivery_arguments(s)
    s.set_defaults(handler=run_sync)

    spool = sub.add_parser("spool", help="an agent's spool on disk")
    actions = spool.add_subparsers(dest="spool_action", required=True)
    r = actions.add_parser(
        "resend",
        help="put refused reports (dead-letter.jsonl) back in their spools and deliver them (after fixing the cause)",
    )
    _delivery_arguments(r)
    r.set_defaults(handler=run_resend)


def _delivery_arguments(p: argparse.ArgumentParser) -> None:
    """What ``sync`` and ``spool resend`` deliver, where, and for how long."""
    p.add_argument("spool_dir", help="a spool directory, or any directory above spools (e.g. .qkwatch/spool)")
    p.add_argument("--collector", default=None, help="collector URL (default: the URL each spool recorded)")
    p.add_argument("--token", default=None, help="bearer token with the ingest scope (default: $QKWATCH_TOKEN)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds per spool")


def run_sync(args: argparse.Namespace) -> int:
    import os

    from qkwatch.agent.shipping.sync import SyncError, sync

    try:
        results = sync(
            args.spool_dir, args.collector, args.token or os.environ.get("QKWATCH_TOKEN"), timeout=args.timeout
        )
    except (SyncError, ValueError) as exc:  # ValueError: a token a header cannot carry (not printed)
        print(f"qkwatch sync: {exc}", file=sys.stderr)
        return 2
    for r in results:
        extra = f", {r.dead_lettered} refused (see {r.spool / 'dead-letter.jsonl'})" if r.dead_lettered else ""
        print(f"{r.spool}: delivered {r.delivered} report(s), {r.left} left{extra}")
    return 0 if all(r.left == 0 for r in results) else 1


def run_resend(args: argparse.Namespace) -> int:
    """``qkwatch spool resend DIR``: each spool's dead letters back in it, then ``qkwatch sync``."""
    from qkwatch.agent.shipping.disk_spool import Spool, SpoolLocked
    from qkwatch.agent.shipping.shipper import requeue_dead_letters
    from qkwatch.agent.shipping.sync import SyncError, find_spools

    try:
        for path in find_spools(args.spool_dir):
            spool = Spool(path)
            try:
                print(f"{path}: {requeue_dead_letters(spool)} refused report(s) back in the spool")
            finally:
                spool.close()
    except (SyncError, SpoolLocked) as exc:
        print(f"qkwatch spool resend: {exc}", file=sys.stderr)
        return 2
    return run_sync(args)


def run_analyze(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from qkwatch.agent.models.layouts import LayoutError, custom
    from qkwatch.agent.offline.analyze import AnalyzeError, analyze
    from qkwatch.agent.offline.render import band, to_csv, to_json, to_table

    try:  # before the model is read: a bad QKWATCH_COLLAPSE_THRESHOLD fails at once
        threshold = Thresholds.resolve(collapse=args.collapse_threshold).collapse
    except ValueError as exc:
        print(f"qkwatch analyze: {exc}", file=sys.stderr)
        return 2
    err = Console(stderr=True)
    try:
        layout = custom(
            args.q_key,
            args.k_key,
            args.qkv_key,
            args.conv1d,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            split=args.split,
        )
        with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("analyzing layers", total=None)
            result = analyze(
                args.path,
                rank=args.rank,
                heads=args.heads,
                spectra=not args.no_spectra,
                layout=layout,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    except (AnalyzeError, LayoutError) as exc:
        print(f"qkwatch analyze: {exc}", file=sys.stderr)  # unwrapped: one greppable line
        return 2
    if args.json:
        sys.stdout.write(to_json(result) + "\n")
    elif args.csv:
        sys.stdout.write(to_csv(result))
    else:
        out = Console()
        out.print(to_table(result, threshold))
        collapsed = band(result, threshold)
        if collapsed:
            out.print(f"[bold red]QKAI above {as_text(threshold)} in layers {', '.join(map(str, collapsed))}[/]")
    return 0
