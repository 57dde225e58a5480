"""The agent's subcommands: ``qkwatch analyze``. Imports only argparse at the top."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="per-layer query-key geometry of a checkpoint file or a HuggingFace model folder",
        description="Reads the query and key projections of every layer (lazily, a chunk of layers at a "
        "time) and prints QKAI, its per-head max, the stable rank of Wq Wk^T, qk_cos and the projection "
        "norms. Knows BERT, GPT-2, Llama/Mistral/Qwen (GQA), nanoGPT and qkwatch's own GPT.",
    )
    p.add_argument("path", help="model folder (config.json + weights) or checkpoint file")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (DESIGN.md's format)")
    fmt.add_argument("--csv", action="store_true", help="CSV, one row per layer")
    p.add_argument("--heads", action="store_true", help="add per-head values")
    p.add_argument("--rank", type=int, default=None, metavar="R", help="r for QKAI (default d_head)")
    p.add_argument("--no-spectra", action="store_true", help="skip the projection SVDs (norms, wk_erank)")
    m = p.add_argument_group("mapping, for checkpoints no layout knows ({i} = layer index)")
    m.add_argument("--q-key", metavar="PATTERN", help="query weight key, e.g. 'blocks.{i}.attn.wq.weight'")
    m.add_argument("--k-key", metavar="PATTERN", help="key weight key")
    m.add_argument("--qkv-key", metavar="PATTERN", help="fused QKV weight key")
    m.add_argument("--conv1d", action="store_true", help="the fused weight is stored (d_model, 3*d_model)")
    m.add_argument("--n-heads", type=int, help="number of query heads")
    m.add_argument("--n-kv-heads", type=int, help="number of key/value heads (GQA)")
    p.set_defaults(handler=run_analyze)


def run_analyze(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from agent.analyze import AnalyzeError, Mapping, analyze
    from agent.render import band, to_csv, to_json, to_table

    err = Console(stderr=True)
    mapping = Mapping(args.q_key, args.k_key, args.qkv_key, args.conv1d, args.n_heads, args.n_kv_heads)
    try:
        with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("analyzing layers", total=None)
            result = analyze(
                args.path,
                rank=args.rank,
                heads=args.heads,
                spectra=not args.no_spectra,
                mapping=mapping,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    except AnalyzeError as exc:
        print(f"qkwatch analyze: {exc}", file=sys.stderr)  # unwrapped: one greppable line
        return 2
    if args.json:
        sys.stdout.write(to_json(result) + "\n")
    elif args.csv:
        sys.stdout.write(to_csv(result))
    else:
        out = Console()
        out.print(to_table(result))
        collapsed = band(result)
        if collapsed:
            out.print(f"[bold red]QKAI above 0.70 in layers {', '.join(map(str, collapsed))}[/]")
    return 0
