"""Red team: text users write, shown back to them, never runs (issue 34).

Run names, project names, notes and event messages carry markup and script (``<script>``,
``"><svg>``, ``javascript:`` URLs, ``onerror`` handlers), Unicode bidi controls and 10 KB strings.
A real collector stores them (what the wire allows: names have no whitespace and no slash, so
their payloads do without); the live page and ``qkwatch report`` show them in a real headless
Chromium. Every payload, if it ran, would set ``window.__xss``: it must stay unset; no element may
carry an ``onerror``/``onload`` handler; no script element may be a payload's (a figure's JSON
may hold the names, as data); no dialog may open (a dialog would block every later evaluation,
so the test would time out); and the text must be on the page as text.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.live import LiveCollector
from tests.monitor.ui.browser import Page, keep, need_chromium
from tests.monitor.ui.runs import N_LAYERS, reports

NAMES = [  # a name has no whitespace and no slash (the wire's NAME_PATTERN): payloads that do without
    "<script>window.__xss=1;alert(1)<!--",
    '"><svg><script>window.__xss=2<!--',
    "<img\u200bsrc=x\u200bonerror=window.__xss=3>",
    "javascript:window.__xss=4",
    "\u202egnp.exe\u202c<b>bidi<b>",
]
PROJECT = "'';!--\"<XSS>=&{()}"
NOTES = (
    '<script>window.__xss=6</script><img src=x onerror="window.__xss=7"> '
    '<a href="javascript:window.__xss=8">click</a> \u202etxt.exe '
) + "x" * 10_000
EVENT = '<img src=x onerror="window.__xss=9">' + "y" * 4000
CLEAN = """(() => ({
  xss: window.__xss === undefined ? null : window.__xss,
  handlers: document.querySelectorAll('[onerror],[onload],[onclick]').length,
  scripts: [...document.scripts].filter((s) => s.textContent.trim().startsWith('window.__xss')).length,
  links: [...document.querySelectorAll('a[href^="javascript:"]')].length,
}))()"""


def shown(text: str) -> str:
    """How the page and the report show text users wrote: bidi controls as [U+XXXX]."""
    return "".join(f"[U+{ord(c):04X}]" if c in "\u202e\u202c" else c for c in text)


def seed_runs(collector: LiveCollector) -> list[dict]:
    client = collector.start().client()
    runs = []
    for name in NAMES:
        run = client.create_run(PROJECT, name, {"n_layers": N_LAYERS}, notes=NOTES)
        batch = reports(range(0, 301, 25), peak=0.95, floor=1.3)  # QKAI above 0.70: alerts fire on these runs
        batch[-1]["events"] = [{"kind": "note", "message": EVENT}]
        client.send_reports(run["id"], batch)
        runs.append(run)
    return runs


def test_the_live_page_shows_hostile_names_notes_and_events_as_text(collector: LiveCollector, tmp_path: Path) -> None:
    need_chromium()
    runs = seed_runs(collector)
    chosen = "&".join(f"run={r['id']}" for r in runs)
    with Page(tmp_path / "profile") as tab:
        tab.goto(f"{collector.url}/?{chosen}")
        tab.wait_for("document.querySelectorAll('#runs tbody tr').length === 5")
        tab.wait_for("document.querySelectorAll('#maps .map .gtitle').length === 5")
        tab.wait_for("document.querySelectorAll('#alerts .alert.firing').length > 0")
        assert tab.eval(CLEAN) == {"xss": None, "handlers": 0, "scripts": 0, "links": 0}
        table = tab.eval("document.getElementById('runs').textContent")
        for name in NAMES:
            assert shown(name) in table, name  # shown, as the text it is
        assert "[U+202E]gnp.exe[U+202C]" in table  # a bidi control is shown, not obeyed: no name passes for another
        titles = tab.eval("[...document.querySelectorAll('#maps .map .gtitle')].map((t) => t.textContent).join('|')")
        assert all(f"{PROJECT}/{shown(name)}" in titles for name in NAMES)
        legend = tab.eval(
            "[...document.querySelectorAll('#latest .legendtext')]"
            ".map((t) => [t.textContent, t.querySelectorAll('*').length])"
        )
        assert [f"{PROJECT}/{shown(name)}" for name in NAMES] == [text for text, _ in legend]
        assert all(parts == 0 for _, parts in legend)  # Plotly's markup in a name (<b>) is not drawn
        strip = tab.eval("document.getElementById('alerts').textContent")
        assert f"{PROJECT}/{NAMES[1]}" in strip
        # 20 alerts (4 a run) in a strip 7.2 lines high: every row keeps its height, and the strip scrolls
        rows = tab.eval("[...document.querySelectorAll('#alerts .alert')].map((a) => a.getBoundingClientRect().height)")
        assert len(rows) == 20 and min(rows) >= 14, rows
        assert tab.eval(
            "(() => { const s = document.getElementById('alerts'); return s.scrollHeight > s.clientHeight; })()"
        )
        keep(tab.screenshot(tmp_path / "hostile-live-page.png", full_page=True))


def at(collector: LiveCollector, out: Path) -> list[str]:
    return ["--url", collector.url, "--out", str(out)]


def test_the_report_shows_hostile_names_notes_and_events_as_text(collector: LiveCollector, tmp_path: Path) -> None:
    need_chromium()
    runs = seed_runs(collector)
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.cli", "report", runs[0]["id"], "--vs", runs[1]["id"], *at(collector, out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with Page(tmp_path / "profile") as tab:
        tab.goto(out.as_uri())
        tab.wait_for("document.querySelectorAll('.js-plotly-plot').length > 0")
        assert tab.eval(CLEAN) == {"xss": None, "handlers": 0, "scripts": 0, "links": 0}
        text = tab.eval("document.body.textContent")
        for name in NAMES[:2]:
            assert name in text, name
        assert NOTES[:60] in text
        keep(tab.screenshot(tmp_path / "hostile-report.png"))
