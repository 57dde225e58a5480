"""``qkwatch report`` against a real collector holding two runs: one self-contained HTML file that a
headless Chromium opens from disk with no network and draws completely; ``--vs`` puts both runs side by
side; a missing URL or an unknown run is a clear error.

Chromium is Debian's ``/usr/bin/chromium``; without it the browser tests skip locally and fail under
CI=true. Screenshots are kept under the test's tmp_path and copied to ``$QKWATCH_ARTIFACTS`` when set.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest

from qkwatch.cli import main
from qkwatch.client.report_data import explain
from qkwatch.client.rest import Client, CollectorError
from qkwatch.contract import colour_scale
from tests.live import ROOT, LiveCollector
from tests.monitor.ui.browser import Page, chromium, keep, need_chromium, png_size, references
from tests.monitor.ui.runs import reports as reports_of
from tests.monitor.ui.runs import seed
from tests.monitor.ui.test_live_page import css_rgb

OVERRIDE = (4, 0.002)  # layer, lambda
FIGURES = (
    "fig-latest",
    "fig-loss",
    "fig-heatmap-qkai-0",
    "fig-heatmap-stable_rank-0",
    "fig-heatmap-attn_entropy-0",
    "fig-heatmap-lambda-0",
    "fig-layers-0",
    "fig-lambdas-0",
)


class Drawn(HTMLParser):
    """Per ``div#fig-*`` of a dumped DOM: how many plotly ``svg.main-svg``, heatmaps and line traces it holds,
    its colour-bar stops and its texts; and every table row: its class and the text of each cell."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.rows: list[tuple[str, list[str]]] = []
        self._figure: str | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = set(a.get("class", "").split())
        if tag == "tr":
            self.rows.append((a.get("class", ""), []))
        elif tag in ("td", "th") and self.rows:
            self.rows[-1][1].append("")
        if tag == "div" and self._figure:
            self._depth += 1
        elif tag == "div" and a.get("id", "").startswith("fig-"):
            self._figure, self._depth = a["id"], 1
            self.figures[self._figure] = {"svgs": 0, "heatmaps": 0, "lines": 0, "stops": [], "texts": []}
        if not self._figure:
            return
        figure = self.figures[self._figure]
        if tag == "svg" and "main-svg" in classes:
            figure["svgs"] += 1
        elif tag == "g" and "hm" in classes:
            figure["heatmaps"] += 1
        elif tag == "g" and {"trace", "scatter"} <= classes:
            figure["lines"] += 1
        elif tag == "stop":
            figure["stops"].append((a["offset"], a["stop-color"]))
        elif tag == "text":
            figure["texts"].append(a.get("data-unformatted", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._figure:
            self._depth -= 1
            if not self._depth:
                self._figure = None

    def handle_data(self, data: str) -> None:
        if self.rows and self.rows[-1][1]:
            self.rows[-1][1][-1] += data

    def table(self, cls: str) -> list[list[str]]:
        """The cells of the rows of class ``cls``."""
        return [[c.strip() for c in cells] for c, cells in self.rows if c == cls]

    def fact(self, name: str) -> list[str]:
        """The summary table's row ``name``: one cell per run."""
        return next(cells[1:] for c, cells in self.rows if cells and cells[0].strip() == name)


def drawn(dom: str) -> Drawn:
    parser = Drawn()
    parser.feed(dom)
    return parser


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict, dict]]:
    """A real collector holding the two seeded runs: (url, vanilla, raa)."""
    with LiveCollector(tmp_path_factory.mktemp("collector")) as live:
        client = live.client()
        vanilla, raa = seed(client)
        client.set_overrides(vanilla["id"], {OVERRIDE[0]: OVERRIDE[1]})  # an entry in the audit trail
        yield live.url, vanilla, raa


@pytest.fixture(scope="module")
def reports(served, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The report of ``demo/vanilla`` alone and compared with the RAA run (named by id), written once."""
    url, _, raa = served
    folder = tmp_path_factory.mktemp("reports")
    out = {"single": folder / "vanilla.html", "vs": folder / "vanilla-vs-raa.html"}
    assert main(["report", "demo/vanilla", "--url", url, "--out", str(out["single"])]) == 0
    assert main(["report", "demo/vanilla", "--vs", raa["id"], "--url", url, "--out", str(out["vs"])]) == 0
    return out


def test_the_report_is_one_file_with_plotly_inlined_once_and_nothing_off_file(reports) -> None:
    for path in reports.values():
        doc = path.read_text()
        assert doc.count("* plotly.js v") == 1  # the library, inlined once
        assert all(u.startswith("#") for u in references(doc)), references(doc)  # only links inside the file
        assert not re.search(r"<script[^>]+src=|<link[^>]+href=|@import|url\(\s*['\"]?(https?:)?//", doc)
        assert "demo/vanilla" in doc


def test_the_report_opens_offline_from_disk_with_every_plot_drawn(reports, tmp_path: Path) -> None:
    need_chromium()
    dom = chromium(reports["single"].as_uri(), tmp_path / "profile", "--dump-dom")
    shown = drawn(dom)

    for figure in FIGURES:
        assert shown.figures[figure]["svgs"] >= 1, figure  # plotly drew it
    assert shown.figures["fig-heatmap-qkai-0"]["heatmaps"] == 1
    assert shown.figures["fig-layers-0"]["lines"] == 8  # one curve per layer
    # The live page's QKAI scale: a sharp break at the threshold, the last calm colour below, the first alarm above.
    at = [c for offset, c in shown.figures["fig-heatmap-qkai-0"]["stops"] if offset == "70%"]
    assert at == [css_rgb(colour_scale.BELOW[-1]), css_rgb(colour_scale.ABOVE[0])]
    assert "<b>0.70 collapse</b>" in shown.figures["fig-heatmap-qkai-0"]["texts"]
    assert "qkwatch report: demo/vanilla" in dom
    assert "demo/raa" not in dom
    # state, severity, rule, layers, onset step, end, last values, since, summary
    assert [c[:4] for c in shown.table("firing") if c[2] == "collapse_band"] == [
        ["firing", "critical", "collapse_band", "3-5"]
    ]
    assert shown.fact("status") == ["running"]
    assert shown.fact("layers above 0.70 (latest qkai)") == ["3-5"]
    assert '"n_layers": 8' in html.unescape(dom)  # the config, pretty-printed
    layer, value = OVERRIDE
    lambdas = shown.table("lambda")  # layer, lambda, override, running entropy, flagged
    assert len(lambdas) == 8 and lambdas[layer][:3] == [str(layer), f"{value:g}", f"{value:g}"]
    audit = shown.table("audit")  # version, step, layer, old, new, who, at
    assert [row[2:6] for row in audit] == [[str(layer), "", f"{value:g}", "open-access (open)"]]


def test_with_vs_both_runs_are_side_by_side(reports, served, tmp_path: Path) -> None:
    need_chromium()
    _, vanilla, raa = served
    dom = chromium(reports["vs"].as_uri(), tmp_path / "profile", "--dump-dom")
    shown = drawn(dom)

    for metric in ("qkai", "stable_rank", "attn_entropy", "logit_max", "lambda"):
        for i in (0, 1):
            assert shown.figures[f"fig-heatmap-{metric}-{i}"]["svgs"] >= 1, (metric, i)
    assert shown.figures["fig-heatmap-qkai-0"]["heatmaps"] == shown.figures["fig-heatmap-qkai-1"]["heatmaps"] == 1
    latest = shown.figures["fig-latest"]
    assert latest["lines"] == 2 and {"demo/vanilla", "demo/raa"} <= set(latest["texts"])
    assert "qkwatch report: demo/vanilla vs demo/raa" in dom
    assert shown.fact("run id") == [vanilla["id"], raa["id"]]
    assert shown.fact("layers above 0.70 (latest qkai)") == ["3-5", "none"]
    assert shown.fact("alerts")[1] == "none"
    assert shown.fact("alerts")[0].startswith("firing: collapse_band (3-5)")


def test_alerts_a_run_ended_with_are_shown_as_ended_while_firing_with_their_last_values(served, tmp_path) -> None:
    """A run finished with its band collapsed: the report shows its alerts as "run ended while firing", with the
    step it finished at and the band's last QKAI, in the alerts table and the summary; none as resolved."""
    url = served[0]
    with Client(url) as client:
        run = client.create_run("ends", "collapsed", {"n_layers": 8})
        client.send_reports(run, reports_of(range(0, 301, 5), peak=0.86, floor=1.3))
        client.set_status(run, "finished")
        ended = {a.rule: a for a in client.alerts(run=run) if a.rule == "collapse_band"}
    out = tmp_path / "ended.html"
    assert main(["report", "ends/collapsed", "--url", url, "--out", str(out)]) == 0
    shown = drawn(out.read_text())
    rows = shown.table("ended")  # state, severity, rule, layers, onset step, end, last values, since, summary
    assert len(rows) == 4 and not shown.table("resolved") and not shown.table("firing")
    assert {r[0] for r in rows} == {"run ended while firing"} and {r[5] for r in rows} == {"run finished at step 300"}
    band = ended["collapse_band"]
    last = ", ".join(f"{la}: {v:.4g}" for la, v in zip(band.layers, band.last_values, strict=True))
    (band_row,) = [r for r in rows if r[2] == "collapse_band"]
    assert band_row[3] == "3-5" and band_row[6] == f"qkai {last}"
    (cell,) = shown.fact("alerts")
    assert cell.startswith(f"run ended while firing (run finished at step 300): collapse_band (3-5; last qkai {last})")
    assert cell.count("qkai_high") == 3 and "resolved" not in cell


def test_screenshot_of_the_report(reports, tmp_path: Path) -> None:
    need_chromium()
    with Page(tmp_path / "profile", width=1400, height=1000) as tab:
        tab.goto(reports["vs"].as_uri())
        tab.wait_for(
            "document.readyState === 'complete' && [...document.querySelectorAll('div[id^=fig-]')]"
            ".every((d) => d.querySelector('.main-svg'))"
        )
        shot = keep(tab.screenshot(tmp_path / "report-vs.png", full_page=True))
    width, height = png_size(shot)
    assert width == 1400 and height > 3000


def test_url_and_token_come_from_the_environment(served, tmp_path: Path, monkeypatch, capsys) -> None:
    url, vanilla, _ = served
    monkeypatch.setenv("QKWATCH_URL", url)
    monkeypatch.setenv("QKWATCH_TOKEN", "unused-by-an-open-collector")
    out = tmp_path / "r.html"
    assert main(["report", vanilla["id"], "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert "demo/vanilla" in out.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "qkwatch report: no collector URL: pass --url URL or set QKWATCH_URL"),
        (["--url", "{url}", "demo/nope"], "qkwatch report: no run 'demo/nope' on the collector"),
        (["--url", "{url}", "0123abcd"], "qkwatch report: no run '0123abcd' on the collector"),
        (["--url", "{url}", "demo/vanilla", "--vs", "other/nope"], "qkwatch report: no run 'other/nope'"),
    ],
)
def test_a_missing_url_or_an_unknown_run_is_a_clear_error(
    served, tmp_path: Path, monkeypatch, capsys, args: list[str], message: str
) -> None:
    monkeypatch.delenv("QKWATCH_URL", raising=False)
    args = [a.format(url=served[0]) for a in args] or ["demo/vanilla"]
    out = tmp_path / "r.html"
    assert main(["report", *args, "--out", str(out)]) == 1
    assert capsys.readouterr().err.startswith(message)
    assert not out.exists()


def test_a_run_without_reports_still_gets_a_report(served, tmp_path: Path) -> None:
    url = served[0]
    with Client(url) as client:
        client.create_run("empty", "fresh", {"n_layers": 4})
    out = tmp_path / "fresh.html"
    assert main(["report", "empty/fresh", "--url", url, "--out", str(out)]) == 0
    doc = out.read_text()
    assert "qkwatch report: empty/fresh" in doc and "no alerts" in doc and "qkai not reported by this run" in doc


def test_the_summary_shows_the_runs_tags_and_notes_escaped_with_their_line_breaks(served, tmp_path: Path) -> None:
    url = served[0]
    notes = "lr sweep, <b>not</b> bold\nsecond line & more"
    with Client(url) as client:
        run = client.create_run("tagged", "run", {"n_layers": 8}, tags=["sweep/a", "baseline"], notes=notes)
        client.send_reports(run, reports_of(range(0, 51, 5), peak=0.3, floor=1.3))
    out = tmp_path / "tagged.html"
    assert main(["report", "tagged/run", "--vs", "demo/vanilla", "--url", url, "--out", str(out)]) == 0
    doc = out.read_text()
    shown = drawn(doc)
    assert shown.fact("tags") == ["baseline sweep/a", "none"]
    assert shown.fact("notes") == [notes, "none"]  # the text as written: nothing of it became markup
    assert '<div class="notes">lr sweep, &lt;b&gt;not&lt;/b&gt; bold\nsecond line &amp; more</div>' in doc
    assert doc.count('<span class="tag">') == 2


def test_a_refused_request_names_the_token_to_give() -> None:
    missing = explain(CollectorError(401, "missing bearer token"), "http://c:8000", None)
    assert missing == "the collector at http://c:8000 wants a read token: pass --token TOKEN or set QKWATCH_TOKEN"
    refused = explain(CollectorError(401, "unknown or revoked token"), "http://c:8000", "qkw_x")
    assert refused == "the collector at http://c:8000 refused the token (401: unknown or revoked token)"


def test_the_report_command_imports_no_torch(served, tmp_path: Path) -> None:
    url, vanilla, _ = served
    code = (
        "import sys; from qkwatch.cli import main; "
        f"rc = main(['report', {vanilla['id']!r}, '--url', {url!r}, '--out', {str(tmp_path / 'r.html')!r}]); "
        "sys.exit(rc or 3 * ('torch' in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
