"""``qkwatch demo``: the collapse band forming in a vanilla run and held back by RAA, side by side, live.

Starts ``qkwatch serve --open`` on 127.0.0.1:8000 (the next free port if 8000 is taken) over
``.qkwatch/demo/collector.db`` and trains the ``collapse_cpu`` recipe twice at once, one CPU thread
each, both reporting to it: ``demo/vanilla`` (RAA off) and ``demo/raa`` (``--set raa.enabled=true``:
the entropy-floor schedule, PAR and the key rotation). In both, the ``qk_collapse`` intervention
induces seed 000's collapse on layers 3-5 from step 150 on; the demo prints the live page's link
(both runs side by side), a progress line every few seconds, and at the end a table read back from
the collector: the band's QKAI, entropy and stable rank in both runs, the fraction of layers RAA's
schedule flagged, the final losses, and the alerts that fired. The runs' own logs go to
``.qkwatch/demo/<run>.log``.

Then the collector keeps serving the runs until Ctrl-C (which stops it, exit status 0), and the demo
prints the commands that query them: ``runs list``, ``runs show``, ``report``, the Python client
and the live page. ``--no-serve`` stops it after the table instead (scripts, CI). The database is
kept: a rerun adds a new pair, ``demo/vanilla-2`` and ``demo/raa-2`` (then ``-3``...), beside the
earlier ones; ``rm -r .qkwatch/demo`` starts afresh. Ctrl-C during training stops everything
(exit status 130).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qkwatch.demo.readout import layer_range, progress_line, summary_table
from qkwatch.demo.runs import DEFAULT_PORT, PROGRESS_SECONDS, PROJECT, Trainee, commands, shown, start_run

if TYPE_CHECKING:
    from qkwatch.client.rest import Client
    from qkwatch.launch import CollectorProcess
    from qkwatch.trainer.run.config import RunConfig

VARIANTS = {"vanilla": [], "raa": ["raa.enabled=true"]}
"""The two runs of the demo and the overrides that make them differ."""
NOT_SHOWN = (
    "The band is induced (qk_collapse, see the README): the demo shows that the pipeline works (metrics, "
    "collector, schedule, PAR); it does not show RAA, or the alerts, working on trouble that nobody designed."
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the collapse band forming without RAA and held with it, live, side by side",
        description=__doc__.replace("``", ""),  # the docstring's reST quoting, not for a terminal
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", default="collapse_cpu", help="trainer recipe (default collapse_cpu)")
    p.add_argument(
        "--port", type=int, default=None, help=f"collector port (default {DEFAULT_PORT}, or the next free one)"
    )
    p.add_argument("--dir", default=".qkwatch/demo", help="where the database, spools, runs and logs live")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides for both runs")
    p.add_argument(
        "--no-serve", action="store_true", help="stop the collector after the summary (scripts, CI) instead of serving"
    )
    p.add_argument(
        "--natural",
        action="store_true",
        help="trouble nobody designed instead: a vanilla run at a hot learning rate beside its safe twin, "
        "qk_norm and RAA at the hot rate (instability_small, nothing induced; about 5 minutes)",
    )
    p.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from qkwatch.launch import CollectorLaunchError, CollectorProcess, first_free_port, port_is_free
    from qkwatch.trainer.cli import resolve_config

    if args.natural:
        from qkwatch.demo.natural import run_natural

        return run_natural(args)

    try:
        cfg = resolve_config(args.recipe, args.set)
    except ValueError as exc:
        print(f"qkwatch demo: {exc}", file=sys.stderr)
        return 2
    if args.port is not None and not port_is_free(args.port):
        print(f"qkwatch demo: port {args.port} is taken; pass another --port, or none", file=sys.stderr)
        return 1
    workdir = Path(args.dir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` ends the demo as Ctrl-C does: nothing left running
    port = args.port or first_free_port(DEFAULT_PORT)
    collector = CollectorProcess(f"sqlite:///{workdir / 'collector.db'}", port=port, log=workdir / "collector.log")
    url = collector.url
    trainees: list[Trainee] = []
    try:
        try:
            collector.start()
        except CollectorLaunchError:
            print(f"qkwatch demo: the collector did not start; see {workdir / 'collector.log'}", file=sys.stderr)
            return 1
        with collector.client(timeout=10.0) as client:
            names = run_names(client)
            sets = {v: [*args.set, *VARIANTS[v]] for v in VARIANTS}
            trainees = [start_run(v, names[v], args.recipe, sets[v], url, workdir) for v in VARIANTS]
            band = band_layers(cfg)
            _announce(
                args.recipe, cfg.train.steps, band, url, workdir, moved=port != DEFAULT_PORT and args.port is None
            )
            print(_naming_note(names, workdir), flush=True)
            _announce_page(client, url, trainees)
            _follow(client, trainees, band, cfg.train.steps)
            failed = [t for t in trainees if t.process.returncode != 0]
            for t in failed:
                print(
                    f"qkwatch demo: the {t.variant} run failed (exit {t.process.returncode}); see {t.log}",
                    file=sys.stderr,
                )
            runs = {t.variant: t.run_id for t in trainees if t.run_id}
            if len(runs) == len(trainees):  # every run reached the collector
                print(summary_table(client, runs, band, onset(cfg)), flush=True)
                if band:
                    print(NOT_SHOWN, flush=True)
        if failed:
            return 1
        if args.no_serve:
            print(f"\nthe collector stops now (--no-serve); {_serve_again(workdir)}", flush=True)
            return 0
        print(queryable(url, names, [t.run_id for t in trainees if t.run_id], workdir), flush=True)
        return _serve(collector, workdir)
    except KeyboardInterrupt:
        return 130
    finally:
        for t in trainees:
            if t.process.poll() is None:
                t.process.send_signal(signal.SIGTERM)
                t.process.wait(timeout=60)
        collector.stop()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the ``finally`` of :func:`run_demo` stops the trainings and the collector."""
    raise KeyboardInterrupt


def _serve(collector: CollectorProcess, workdir: Path) -> int:
    """Wait for Ctrl-C (0) or the collector's own end (1); the caller stops the collector."""
    try:
        code = collector.wait()
    except KeyboardInterrupt:
        print(f"\nCtrl-C: the collector stops; {_serve_again(workdir)}", flush=True)
        return 0
    print(f"qkwatch demo: the collector exited (status {code}); see {workdir / 'collector.log'}", file=sys.stderr)
    return 1


def run_names(client: Client) -> dict[str, str]:
    """The names of this demo's runs (variant -> name, in project ``demo``).

    ``vanilla`` and ``raa`` in a database that has neither, else the first free numbered pair,
    ``vanilla-2`` and ``raa-2``, then ``-3``... A rerun is a new run, not a new attempt of the old
    one: an attempt continues its run (the collector carries the schedule's running entropy and the
    alerts' state over to it, and reads merge the attempts), while a rerun starts again at step 0.
    """
    pairs = ({variant: variant if n == 1 else f"{variant}-{n}" for variant in VARIANTS} for n in itertools.count(1))
    return next(pair for pair in pairs if not any(client.runs(project=PROJECT, name=n)["count"] for n in pair.values()))


def queryable(url: str, names: dict[str, str], run_ids: list[str], workdir: Path) -> str:
    """What the demo prints while it serves: the commands that query its runs, each as it runs from here."""
    from qkwatch.client.rest import DEFAULT_URL

    default = url == DEFAULT_URL and os.environ.get("QKWATCH_URL", DEFAULT_URL) == DEFAULT_URL
    at = "" if default else f" --url {url}"
    qkwatch, python = commands()
    vanilla, raa = (f"{PROJECT}/{names[v]}" for v in VARIANTS)
    page = f"{url}/?" + "&".join(f"run={run_id}" for run_id in run_ids)
    report = shown(workdir / "report.html")
    return "\n".join(
        [
            f"\nthe collector keeps serving {vanilla} and {raa} at {url} until Ctrl-C; from this directory,",
            "in another terminal:",
            f"  live page:  {page}",
            f"  {qkwatch} runs list{at}",
            f"  {qkwatch} runs show {vanilla}{at}",
            f"  {qkwatch} report {vanilla} --vs {raa} --out {report}{at}",
            f"  {python}, then:",
            "    import qkwatch",
            f'    c = qkwatch.Client("{url}")',
            f'    print([(r.ref, r.status, r.last_step) for r in c.search_runs("{PROJECT}")])',
        ]
    )


def _announce(recipe: str, steps: int, band: list[int], url: str, workdir: Path, moved: bool) -> None:
    taken = f" (port {DEFAULT_PORT} is taken)" if moved else ""
    print(
        f"\nqkwatch demo: {recipe} twice, vanilla and with RAA, into the collector at {url}{taken}\n"
        f"  (about {steps} steps each; the band is induced on layers {layer_range(band)}; logs in {shown(workdir)})",
        flush=True,
    )


def _naming_note(names: dict[str, str], workdir: Path) -> str:
    runs = " and ".join(f"{PROJECT}/{name}" for name in names.values())
    kept = f"kept in {shown(workdir / 'collector.db')}"
    afresh = f"rm -r {shown(workdir)} starts afresh"
    if all(name == variant for variant, name in names.items()):
        return f"  runs {runs}, {kept} (a rerun adds {PROJECT}/vanilla-2 and {PROJECT}/raa-2; {afresh})"
    return f"  runs {runs}, {kept} beside the earlier demo runs ({afresh})"


def _serve_again(workdir: Path) -> str:
    qkwatch, _ = commands()
    database = shlex.quote(f"sqlite:///{shown(workdir / 'collector.db', quote=False)}")
    return f"the runs stay in its database; to serve them again: {qkwatch} serve --open --database-url {database}"


def onset(cfg: RunConfig) -> int:
    """The step the recipe's induced collapse begins at (0 without one)."""
    return cfg.intervention.collapse_start if cfg.intervention.kind == "qk_collapse" else 0


def band_layers(cfg: RunConfig) -> list[int]:
    """The layers the recipe's intervention collapses (none for a recipe without one)."""
    if cfg.intervention.kind == "qk_collapse" and cfg.intervention.layers:
        return list(cfg.intervention.layers)
    return []


# --- processes ------------------------------------------------------------------------------------


def _announce_page(client: Client, url: str, trainees: list[Trainee], timeout: float = 180.0) -> None:
    """Print the live page's link, with both runs selected, once the agents have created them."""
    from qkwatch.client.rest import CollectorError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(t.run_id is None and t.process.poll() is None for t in trainees):
        for t in trainees:
            if t.run_id is None:
                try:
                    found = client.runs(project=PROJECT, name=t.name)["data"]
                except CollectorError:
                    found = []
                t.run_id = found[0]["id"] if found else None
        time.sleep(0.5)
    if not all(t.run_id for t in trainees):
        return
    link = f"{url}/?" + "&".join(f"run={t.run_id}" for t in trainees)
    rule = "=" * max(60, len(link) + 4)
    print(
        f"\n{rule}\n  live page:  {link}\n  (the vanilla and the RAA run side by side; refreshes every 5 s)\n{rule}\n",
        flush=True,
    )


def _follow(client: Client, trainees: list[Trainee], band: list[int], steps: int) -> None:
    """Until every run ends: a progress line every PROGRESS_SECONDS, read from the collector."""
    from qkwatch.client.rest import CollectorError

    last = 0.0
    while any(t.process.poll() is None for t in trainees):
        time.sleep(0.5)
        if time.monotonic() - last < PROGRESS_SECONDS:
            continue
        last = time.monotonic()
        try:
            parts = [progress_line(client, t.variant, t.run_id, band) for t in trainees if t.run_id]
        except CollectorError:
            continue
        print("  " + "   |   ".join(parts), flush=True)
