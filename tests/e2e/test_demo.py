"""``qkwatch demo`` end to end, shortened: the band forms in the vanilla run and RAA holds it, in the collector's
data, and the demo then serves its runs until Ctrl-C with commands that work as printed.

The demo trains ``collapse_cpu`` twice (vanilla and RAA) into a real collector; here it is cut to
240 steps with the induced collapse from step 40 to 160 (the full demo: 800 steps, 150 to 650).
It runs as a user runs it, serving after its summary, on a free port other than 8000, so the
printed commands must name it. Everything asserted about the runs is read back from the collector
the demo leaves serving; then a Ctrl-C, sent to its process group as a terminal sends it, stops it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from qkwatch.client.rest import Client
from tests.e2e.test_demo_commands import run_printed
from tests.live import ROOT, free_port

pytestmark = pytest.mark.slow

SHORT = [
    "train.steps=240",
    "intervention.collapse_start=40",
    "intervention.collapse_ramp=120",
    "train.report_every=10",
    "train.log_every=10",
    "checkpoint.every=1000",
]
BAND = [3, 4, 5]


def _band_mean(row: list, layers: list[int]) -> float:
    return sum(row[i] for i in layers) / len(layers)


def test_demo_shows_the_band_forming_without_raa_and_held_with_it_then_serves_it(tmp_path: Path) -> None:
    sets = [x for kv in SHORT for x in ("--set", kv)]
    port = free_port()
    command = [sys.executable, "-m", "qkwatch.cli", "demo", "--dir", str(tmp_path), "--port", str(port), *sets]
    with (tmp_path / "demo.stderr").open("w+") as stderr:
        with _sigint_heard():
            demo = subprocess.Popen(
                command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
            )
        try:
            lines = Lines(demo)
            out = lines.until(re.compile(r"^    print\("), timeout=900)  # the client snippet's last line
            print(out)  # shown when the test fails
            _check_summary(out, port)
            link = re.search(r"live page:\s+((http://127\.0\.0\.1:\d+)/\?run=(\w+)&run=(\w+))", out)
            assert link and link.group(2) == f"http://127.0.0.1:{port}", out
            assert httpx.get(link.group(1), timeout=10).status_code == 200
            listed, shown, _, snippet = run_printed(out[out.index("keeps serving") :], cwd=ROOT)
            assert re.search(r"\sdemo/vanilla\s", listed) and re.search(r"\sdemo/raa\s", listed), listed
            assert '"name": "vanilla"' in shown and '"status": "finished"' in shown, shown
            assert (tmp_path / "report.html").stat().st_size > 100_000  # plotly.js is inlined
            for name in ("vanilla", "raa"):
                assert f"('demo/{name}', 'finished', 239)" in snippet, snippet  # steps 0-239
            with Client(link.group(2)) as client:
                _check_runs(client, {link.group(3), link.group(4)})
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C, to the process group as a terminal sends it
            demo.wait(timeout=90)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
        stderr.seek(0)
        rest = lines.rest() + stderr.read()
    assert demo.returncode == 0, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert re.search(r"^Ctrl-C: the collector stops; the runs stay in its database", rest, re.M), rest
    with pytest.raises(httpx.ConnectError):  # the collector stopped with the demo
        httpx.get(f"{link.group(2)}/healthz", timeout=2)


@contextlib.contextmanager
def _sigint_heard() -> Iterator[None]:
    """While it lasts, a child started here hears SIGINT even if this process ignores it (pytest run
    as a script's background job): an ignored signal stays ignored across exec, a handled one does not."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


class Lines:
    """A process's stdout, line by line, read by a thread (a pipe read cannot time out)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()  # None: the output ended
        self._reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._reader.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        for line in process.stdout or ():
            self._lines.put(line)
        self._lines.put(None)

    def until(self, last: re.Pattern[str], timeout: float) -> str:
        """The lines up to the first that matches ``last``; fails if the output ends or time runs out first."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while not seen or not last.match(seen[-1]):
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"no line matching {last.pattern!r} in {timeout:g} s:\n{''.join(seen)}")
            seen.append(line)
        return "".join(seen)

    def rest(self) -> str:
        """The lines after those read so far, once the process has ended."""
        self._reader.join(timeout=10)
        rest = []
        while not self._lines.empty() and (line := self._lines.get()) is not None:
            rest.append(line)
        return "".join(rest)


def _check_summary(out: str, port: int) -> None:
    assert f"into the collector at http://127.0.0.1:{port}\n" in out, out  # an explicit --port is kept
    assert re.search(r"runs demo/vanilla and demo/raa, kept in .*collector\.db \(a rerun adds", out), out
    assert "HTTP Request" not in out  # httpx is quiet: the link is not buried
    assert re.search(r"alerts that fired\s+collapse_band, qkai_high\s+none", out), out
    # the vanilla run ends with its band collapsed: its alerts ended with it while firing, and the tag stays
    assert re.search(r"still firing at the end\s+ALERT (collapse_band|qkai_high)[, \w]*\s+none\n", out), out
    assert re.search(r"status\s+finished\s+finished", out), out
    assert "it does not show RAA, or the alerts, working on trouble that nobody designed" in out, out


def _check_runs(client: Client, linked: set[str]) -> None:
    runs = {r["name"]: r for r in client.runs(project="demo")["data"]}
    assert set(runs) == {"vanilla", "raa"} and {runs["vanilla"]["id"], runs["raa"]["id"]} == linked
    assert runs["vanilla"]["status"] == runs["raa"]["status"] == "finished"
    qkai = {v: client.heatmap(runs[v]["id"], "qkai", max_steps=20_000) for v in ("vanilla", "raa")}
    vanilla, raa = qkai["vanilla"]["values"], qkai["raa"]["values"]
    outside = [i for i in range(8) if i not in BAND]
    # the band forms: below 0.5 at the first report, past 0.70 by the end; the other layers stay below 0.5
    assert _band_mean(vanilla[0], BAND) < 0.5 and _band_mean(vanilla[-1], BAND) >= 0.70
    assert max(row[i] for row in vanilla for i in outside) < 0.5
    # RAA holds it (seed 000: 0.42-0.49; tau = 0.45 r). The full demo peaks at 0.54; here the
    # pressure ramps 4x steeper while RAA's lambdas reach the trainer by polling (5 s, more steps
    # on a loaded machine), so the peak may overshoot a little: one run under the full suite read 0.552
    assert max(_band_mean(row, BAND) for row in raa) <= 0.60
    alerts = {v: {a["rule"] for a in client.alerts(run=runs[v]["id"])["data"]} for v in ("vanilla", "raa")}
    assert "collapse_band" in alerts["vanilla"] and not alerts["raa"]
    _check_backtest(client, runs["vanilla"]["id"])
    # RAA's schedule flagged the band and PAR acted there
    lam = client.heatmap(runs["raa"]["id"], "lambda", max_steps=20_000)["values"][-1]
    par = client.heatmap(runs["raa"]["id"], "par", max_steps=20_000)["values"][-1]
    assert min(lam[i] for i in BAND) >= 0.5 * 5e-3 and all(par[i] > 0 for i in BAND)


def _check_backtest(client: Client, run: str) -> None:
    """The backtest reproduces the live collector on the demo's run: every alert the collector
    opened (rule, onset step, and the layer of a per-layer rule: a band's layers may move after it
    opens) is the replay's, read back over REST and run through the same evaluator and rules."""
    from qkwatch.client import backtest, run_history
    from qkwatch.rules.ruleset import RuleSet

    rules = RuleSet.default(client.thresholds().collapse)
    bands = {b.name for b in rules.bands}

    def key(rule: str, layers: tuple[int, ...], onset: int) -> tuple[str, tuple[int, ...], int]:
        return rule, () if rule in bands else layers, onset

    live = sorted(key(a["rule"], tuple(a["layers"]), a["onset_step"]) for a in client.alerts(run=run)["data"])
    replay = backtest.replay(rules, run_history.read(client, run).reports)
    assert live and sorted(key(f.rule, f.layers, f.onset_step) for f in replay) == live, (live, replay)
