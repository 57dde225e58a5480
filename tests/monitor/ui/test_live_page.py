"""The live page in a real headless Chromium against a real collector: the compare view draws one
heatmap per run in the URL, titled with the run, on a QKAI colour scale that breaks at the served
collapse threshold; the alerts strip shows the chosen runs' alerts, firing ones in red; the loss
curve is drawn; and the page follows new reports without a reload. A run at step 0 gets an axis
of whole steps, no tick label is cut off at any of the page's chart sizes, fifty runs stay in a
bounded, scrolling table, and the colour scale's break survives colour-vision deficiencies.

Chromium is Debian's ``/usr/bin/chromium`` (installed by ``.ci/run``); without it the browser tests
skip locally and fail under CI=true. Screenshots are kept under the test's tmp_path and copied to
``$QKWATCH_ARTIFACTS`` when that is set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from qkwatch.client.report_figures import threshold_scale
from qkwatch.contract import api, colour_scale
from qkwatch.contract import metrics as catalogue
from qkwatch.contract.thresholds import Thresholds
from qkwatch.dashboards import generate
from qkwatch.monitor.main import create_app
from tests.live import ROOT, LiveCollector
from tests.monitor.conftest import make_settings
from tests.monitor.ui.browser import Page, chromium, keep, need_chromium, png_size
from tests.monitor.ui.colour_vision import VISIONS, delta_e, ramp, seen, srgb
from tests.monitor.ui.runs import N_LAYERS, STEPS, VAL_EVERY, first_steps, reports, seed, sweep

FIRING_RED = "rgb(176, 0, 32)"  # #b00020, the strip's firing badge
ENDED_AMBER = "rgb(160, 64, 0)"  # #a04000, the badge of an alert its run ended with
RESOLVED_GREY = "rgb(221, 221, 221)"  # #ddd
DRAWN = "document.getElementById('status').textContent.startsWith('updated')"
"""True once the page has drawn the chosen runs (the status line says when)."""


def css_rgb(colour: str) -> str:
    """``#rrggbb`` as the browser writes it in the DOM: ``rgb(r, g, b)``."""
    return "rgb({}, {}, {})".format(*(int(colour[i : i + 2], 16) for i in (1, 3, 5)))


def served_config(url: str) -> dict:
    return httpx.get(f"{url}/ui/config.json").json()


class Figures(HTMLParser):
    """The plotly figures of a dumped DOM, in page order: each ``div.map``, ``div#latest`` and ``div#loss``
    with its title, numbers of heatmap and line traces, colour-bar gradient stops and the raw texts of its
    labels."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict] = []
        self._depth = 0  # divs open inside the current figure; 0 outside one
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "div":
            if self._depth:
                self._depth += 1
            elif "map" in classes or a.get("id") in ("latest", "loss"):
                self._depth = 1
                self.figures.append(
                    {
                        "run": a.get("data-run", a.get("id")),
                        "title": "",
                        "heatmaps": 0,
                        "lines": 0,
                        "stops": [],
                        "texts": [],
                    }
                )
            return
        if not self._depth:
            return
        figure = self.figures[-1]
        if tag == "g" and "hm" in classes:
            figure["heatmaps"] += 1
        elif tag == "g" and {"trace", "scatter"} <= set(classes):
            figure["lines"] += 1
        elif tag == "stop":
            figure["stops"].append((a["offset"], a["stop-color"]))
        elif tag == "text":
            self._in_title = "gtitle" in classes
            figure["texts"].append(a.get("data-unformatted", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._depth:
            self._depth -= 1
        elif tag == "text":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.figures[-1]["title"] += data


def figures(dom: str) -> dict[str, list[dict] | dict]:
    """{"maps": [per run, in page order], "latest": ..., "loss": ...}."""
    parser = Figures()
    parser.feed(dom)
    shown = parser.figures
    return {
        "maps": [f for f in shown if f["run"] not in ("latest", "loss")],
        **{f["run"]: f for f in shown if f["run"] in ("latest", "loss")},
    }


class Alerts(HTMLParser):
    """The rows of the alerts strip: the data attributes and the text of each ``#alerts .alert``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if self._depth:
            self._depth += tag not in ("br", "img", "input")
        elif tag == "div" and "alert" in a.get("class", "").split():
            self._depth = 1
            self.rows.append(
                {
                    "class": a["class"],
                    "run": a.get("data-run"),
                    "rule": a.get("data-rule"),
                    "state": a.get("data-state"),
                    "text": "",
                }
            )

    def handle_endtag(self, tag: str) -> None:
        if self._depth:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._depth:
            self.rows[-1]["text"] += data


def alert_rows(dom: str) -> list[dict]:
    parser = Alerts()
    parser.feed(dom)
    return parser.rows


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict, dict]]:
    """A real collector holding the two seeded runs: (url, vanilla, raa)."""
    need_chromium()
    with LiveCollector(tmp_path_factory.mktemp("collector")) as live:
        vanilla, raa = seed(live.client())
        yield live.url, vanilla, raa


@pytest.fixture(scope="module")
def compare_dom(page, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The compare view of both runs, dumped once for the tests that only read it."""
    url, vanilla, raa = page
    return chromium(f"{url}/?run={vanilla['id']}&run={raa['id']}", tmp_path_factory.mktemp("profile"), "--dump-dom")


def test_compare_view_draws_one_heatmap_per_run_with_the_threshold_break(page, compare_dom: str) -> None:
    url, vanilla, raa = page
    config = served_config(url)
    assert config == {
        "collapse_threshold": 0.70,
        "h_star": 0.85,
        "colour_scale": colour_scale.as_json(),
        "metrics": catalogue.as_json(),
        "alert_state_text": api.ALERT_STATE_TEXT,
    }
    below, above = config["colour_scale"]["below"], config["colour_scale"]["above"]

    shown = figures(compare_dom)

    maps, latest = shown["maps"], shown["latest"]
    assert [m["run"] for m in maps] == [vanilla["id"], raa["id"]]  # the URL's order
    assert [m["heatmaps"] for m in maps] == [1, 1]
    assert "demo/vanilla (running)" in maps[0]["title"]
    assert "3 layers above 0.70: 3, 4, 5" in maps[0]["title"]
    assert "demo/raa (running)" in maps[1]["title"]
    assert "no layer above 0.70" in maps[1]["title"]
    for m in maps:
        # A sharp break: two colour-bar stops at the threshold, the served scale's last calm colour and first alarm.
        at = [color for offset, color in m["stops"] if offset == "70%"]
        assert at == [css_rgb(below[-1]), css_rgb(above[0])], m["stops"]
        assert "<b>0.70 collapse</b>" in m["texts"]
    assert "latest qkai per layer" in latest["title"]
    assert {"demo/vanilla", "demo/raa", "collapse 0.70"} <= set(latest["texts"])


def test_alerts_strip_shows_the_collapsing_runs_firing_alerts_first(page, compare_dom: str) -> None:
    url, vanilla, raa = page
    expected = httpx.get(f"{url}/v1/alerts", params={"run": vanilla["id"], "state": "firing"}).json()["data"]
    band = next(a for a in expected if a["rule"] == "collapse_band")

    rows = alert_rows(compare_dom)

    assert rows, "no alerts strip"
    first = rows[0]  # firing, and the critical band before the per-layer warnings
    assert (first["run"], first["rule"], first["state"]) == (vanilla["id"], "collapse_band", "firing")
    assert first["class"].split() == ["alert", "firing"]
    for text in (
        "firing",
        "collapse_band",
        "critical",
        "demo/vanilla",
        "layers 3-5",
        f"onset step {band['onset_step']}",
    ):
        assert text in first["text"], (text, first["text"])
    assert {(r["run"], r["rule"]) for r in rows} == {(vanilla["id"], a["rule"]) for a in expected}
    assert all(r["state"] == "firing" for r in rows)
    assert not any(r["run"] == raa["id"] for r in rows)  # the RAA run raised nothing


def test_loss_curve_draws_train_and_validation_loss_of_each_run(compare_dom: str) -> None:
    loss = figures(compare_dom)["loss"]
    assert "loss (train solid, validation dashed)" in loss["title"]
    assert loss["lines"] == 4  # train and validation, two runs
    assert {"demo/vanilla", "demo/raa"} <= set(loss["texts"])  # one legend entry per run
    assert "no loss reported yet" not in loss["texts"]


def test_without_runs_in_the_url_the_running_runs_are_compared(page, tmp_path: Path) -> None:
    url, vanilla, raa = page
    maps = figures(chromium(f"{url}/?metric=attn_entropy", tmp_path / "profile", "--dump-dom"))["maps"]
    assert {m["run"] for m in maps} == {vanilla["id"], raa["id"]}
    assert all(m["heatmaps"] == 1 and "no layer above" not in m["title"] for m in maps)
    assert all(not any("collapse" in t for t in m["texts"]) for m in maps)  # no threshold outside QKAI


def test_screenshot_of_the_compare_view(page, tmp_path: Path) -> None:
    url, vanilla, raa = page
    shot = tmp_path / "live-page-compare.png"
    chromium(
        f"{url}/?run={vanilla['id']}&run={raa['id']}",
        tmp_path / "profile",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        "--window-size=1400,900",
    )
    keep(shot)
    assert png_size(shot) == (1400, 900)
    assert shot.stat().st_size > 20_000  # drawn, not blank


def test_the_page_follows_new_reports_without_a_reload(collector: LiveCollector, tmp_path: Path) -> None:
    """One page stays open while a run reports on: its heatmap, alerts strip and loss curve catch up on the
    next refresh (every 5 s), and the URL keeps naming the run."""
    need_chromium()
    client = collector.start().client()
    run = client.create_run("demo", "growing", {"n_layers": N_LAYERS})
    early = [s for s in STEPS if s <= 100]
    client.send_reports(run["id"], reports(early, peak=0.86, floor=1.3))
    title = f"(document.querySelector('#maps .map[data-run=\"{run['id']}\"] .gtitle')?.textContent || '')"
    loss_steps = "(document.getElementById('loss').data || []).map((t) => t.x[t.x.length - 1])"

    with Page(tmp_path / "profile") as tab:
        tab.goto(f"{collector.url}/?run={run['id']}")
        assert "step 100" in tab.wait_for(f"{title}.includes('step 100') && {title}")
        assert tab.eval("document.querySelector('#alerts .alert').className") == "alert none"
        assert tab.eval(loss_steps) == [100, 100]  # train and validation
        assert tab.eval("location.search") == f"?run={run['id']}"  # a link to this view

        client.send_reports(run["id"], reports([s for s in STEPS if s > 100], peak=0.86, floor=1.3))

        shown = tab.wait_for(f"{title}.includes('step 300') && {title}", timeout=20)
        assert "3 layers above 0.70: 3, 4, 5" in shown
        badge = tab.wait_for(
            "document.querySelector('#alerts .alert.firing[data-rule=\"collapse_band\"] .state')"
            " && getComputedStyle(document.querySelector('#alerts .alert.firing .state'))"
            ".backgroundColor"
        )
        assert badge == FIRING_RED
        assert tab.eval(loss_steps) == [STEPS[-1], STEPS[-1] - STEPS[-1] % VAL_EVERY]
        assert tab.eval("location.search") == f"?run={run['id']}"
        shot = keep(tab.screenshot(tmp_path / "live-page-after-new-reports.png"))
    assert png_size(shot) == (1400, 900)


def test_the_strip_shows_every_kind_of_alert_with_its_summary(tmp_path: Path) -> None:
    """With the candidate detectors (qkwatch/dashboards/rules/detectors.yml), reports every 10 steps from step 5:
    layer 1's QKAI rises 0.001 per step from 0.3 (crossing 0.70 at step 400; the forecast's 24 reports
    say so from step 305), layer 2's largest logit jumps to 4x its early value at step 155,
    layer 3's stable rank falls below 1.2 from step 125. The strip shows each alert with the summary that says why; the
    forecast's row names its predicted crossing step."""
    need_chromium()
    rules = ROOT / "qkwatch" / "dashboards" / "rules" / "detectors.yml"
    with LiveCollector(tmp_path, None, "--rules", str(rules)) as live:
        client = live.client()
        run = client.create_run("demo", "trouble", {"n_layers": 4})
        steps = range(5, 306, 10)
        client.send_reports(
            run["id"],
            [
                {
                    "step": s,
                    "time": float(s),
                    "layers": {
                        "qkai": [0.3, 0.3 + 0.001 * s, 0.3, 0.3],
                        "logit_max": [5.0, 5.0, 5.0 if s <= 150 else 20.0, 5.0],
                        "stable_rank": [2.0, 2.0, 2.0, 2.0 - s / 150],
                    },
                }
                for s in steps
            ],
        )
        expected = httpx.get(f"{live.url}/v1/alerts", params={"run": run["id"]}).json()["data"]
        rows = alert_rows(chromium(f"{live.url}/?run={run['id']}", tmp_path / "profile", "--dump-dom"))
    assert {a["rule"] for a in expected} == {"qkai_forecast", "logit_growth", "stable_rank_low"}
    shown = {r["rule"]: r for r in rows}
    assert set(shown) == {a["rule"] for a in expected}
    for a in expected:
        assert a["summary"] in shown[a["rule"]]["text"], (a["summary"], shown[a["rule"]]["text"])
        assert shown[a["rule"]]["class"].split() == ["alert", "firing"]
    forecast = shown["qkai_forecast"]["text"]
    assert "layer 1" in forecast and "predicted crossing step 400" in forecast
    assert "crosses 0.70 in about 95 steps (at step ~400)" in forecast
    assert "layer 2: logit_max 4.0x its early value (20 vs 5;" in shown["logit_growth"]["text"]
    assert "predicted crossing" not in shown["logit_growth"]["text"]


def test_config_is_served_without_a_token_and_follows_the_settings(sqlite_url: str) -> None:
    with TestClient(create_app(make_settings(sqlite_url, collapse_threshold=0.65, h_star=0.8))) as client:
        assert client.get("/v1/runs").status_code == 401
        r = client.get("/ui/config.json")
    assert r.status_code == 200
    assert r.json() == {
        "collapse_threshold": 0.65,
        "h_star": 0.8,
        "colour_scale": colour_scale.as_json(),
        "metrics": catalogue.as_json(),
        "alert_state_text": api.ALERT_STATE_TEXT,
    }
    assert r.headers["cache-control"] == "no-store"


def test_an_alert_still_firing_when_its_run_ended_is_amber_and_keeps_its_last_values(tmp_path: Path) -> None:
    """vanilla finishes with its band collapsed: its alerts show "run ended while firing" on an amber badge,
    with the step the run finished at and the band's last QKAI, ranked above a resolved alert (grey) of
    another run that healed; none of the ended ones reads resolved."""
    need_chromium()
    with LiveCollector(tmp_path) as live:
        client = live.client()
        vanilla, _ = seed(client)
        client.set_status(vanilla["id"], "finished")
        healed = client.create_run("demo", "healed", {"n_layers": N_LAYERS})
        hot = [0.9] + [0.2] * (N_LAYERS - 1)
        client.send_reports(healed["id"], [{"step": s, "time": float(s), "layers": {"qkai": hot}} for s in (0, 5, 10)])
        client.send_reports(healed["id"], [{"step": 15, "time": 15.0, "layers": {"qkai": [0.3] * N_LAYERS}}])
        ended = {a["rule"]: a for a in client.alerts(run=vanilla["id"], state="ended")["data"] if len(a["layers"]) > 1}
        url = f"{live.url}/?run={vanilla['id']}&run={healed['id']}"
        rows = alert_rows(chromium(url, tmp_path / "profile", "--dump-dom"))
        with Page(tmp_path / "profile-tab") as tab:
            tab.goto(url)
            style = "(s) => s && getComputedStyle(s).backgroundColor"
            badge = tab.wait_for(f"({style})(document.querySelector('#alerts .alert.ended .state'))")
            grey = tab.wait_for(f"({style})(document.querySelector('#alerts .alert.resolved .state'))")
            upper = tab.eval("getComputedStyle(document.querySelector('#alerts .alert.ended .state')).textTransform")
            # the finished run's map keeps its last values: the band above the threshold, not healed
            title = tab.wait_for(
                f"document.querySelector('#maps .map[data-run=\"{vanilla['id']}\"] .gtitle')?.textContent"
            )
            shot = keep(tab.screenshot(tmp_path / "live-page-run-ended-while-firing.png"))
    assert "(finished)" in title and "3 layers above 0.70: 3, 4, 5" in title
    assert (badge, grey, upper) == (ENDED_AMBER, RESOLVED_GREY, "uppercase")
    assert png_size(shot) == (1400, 900)
    states = [r["state"] for r in rows]
    assert states == sorted(states, key=["ended", "resolved"].index) and set(states) == {"ended", "resolved"}
    mine = [r for r in rows if r["run"] == vanilla["id"]]
    assert mine and all(r["class"].split() == ["alert", "ended"] for r in mine)
    band = next(r for r in mine if r["rule"] == "collapse_band")
    last = ", ".join(
        f"{la}: {v:.3g}"
        for la, v in zip(ended["collapse_band"]["layers"], ended["collapse_band"]["last_values"], strict=True)
    )
    assert band["text"].startswith("run ended while firing")
    assert f"run finished at step {STEPS[-1]}" in band["text"] and f"last qkai {last}" in band["text"]
    assert "resolved" not in band["text"]
    (other,) = [r for r in rows if r["run"] == healed["id"]]
    assert other["class"].split() == ["alert", "resolved"] and "resolved step 15" in other["text"]


# ---- the colour scale ---------------------------------------------------------------------------

MIN_DELTA_E = 25.0
"""CIE76 distance every colour above the threshold keeps from every colour below it, under each vision
(a just-noticeable difference is about 2.3; 25 is a different colour at a glance)."""
MIN_LIGHTNESS_GAP = 10.0
"""L* by which the lightest colour above the threshold is darker than the darkest below it, under each vision."""


def grafana_qkai_steps(t: Thresholds) -> list[tuple[float | None, str]]:
    """The colour steps of the generated run dashboard's QKAI heatmap."""
    board = json.loads(generate.render(t)["grafana/dashboards/run.json"])
    (panel,) = [p for p in board["panels"] if p["title"].startswith("QKAI per layer and step")]
    return [(s["value"], s["color"]) for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_the_colour_scale_breaks_for_every_colour_vision_and_is_sequential_below(sqlite_url: str) -> None:
    """The QKAI scale where the page gets it (``/ui/config.json``), sampled as plotly interpolates it, and the
    Grafana dashboard's steps, seen with normal vision and with a simulated deuteranopia, protanopia and
    tritanopia (Machado et al. 2009): (a) every colour above the threshold is darker than every colour below it
    by MIN_LIGHTNESS_GAP L* or more, and at least MIN_DELTA_E (CIE76) from it; (b) below the threshold, going up
    towards it, the scale darkens and comes closer to the first alarm colour at every sample: the nearer the
    threshold, the more alarming; the Grafana steps darken step by step."""
    with TestClient(create_app(make_settings(sqlite_url))) as client:
        config = client.get("/ui/config.json").json()
    t, scale = config["collapse_threshold"], config["colour_scale"]
    steps = grafana_qkai_steps(Thresholds(collapse=t))
    assert [v for v, _ in steps].count(t) == 1  # Grafana breaks at the same threshold
    below_steps = srgb([c for v, c in steps if v is None or v < t])
    above_steps = srgb([c for v, c in steps if v is not None and v >= t])
    assert len(below_steps) >= 2 and len(above_steps) >= 2

    for vision in VISIONS:
        below, above = seen(ramp(scale["below"]), vision), seen(ramp(scale["above"]), vision)  # bottom to top
        # (a) the break
        assert below[:, 0].min() - above[:, 0].max() >= MIN_LIGHTNESS_GAP, vision
        assert delta_e(below, above).min() >= MIN_DELTA_E, vision
        grafana_below, grafana_above = seen(below_steps, vision), seen(above_steps, vision)
        assert grafana_below[:, 0].min() - grafana_above[:, 0].max() >= MIN_LIGHTNESS_GAP, vision
        assert delta_e(grafana_below, grafana_above).min() >= MIN_DELTA_E, vision
        # (b) sequential below, towards the alarm
        assert (np.diff(below[:, 0]) < 0).all(), (vision, below[:, 0])
        to_alarm = delta_e(below, above[:1])[:, 0]
        assert (np.diff(to_alarm) < 0).all(), (vision, to_alarm)
        assert (np.diff(seen(srgb([c for _, c in steps]), vision)[:, 0]) < 0).all(), vision


def test_the_page_and_the_report_draw_the_served_scale(page, tmp_path: Path) -> None:
    """The page builds its QKAI colour scale from ``/ui/config.json`` exactly as ``qkwatch report`` builds its own
    from ``qkwatch.contract.colour_scale``; nothing measured shows the scale's gap colour. A screenshot of the
    band forming is kept."""
    url, vanilla, raa = page
    t = served_config(url)["collapse_threshold"]
    drawn = (
        "(() => { const d = document.querySelector('#maps .map');"
        " return d && d.data && d.data.length && {scale: d.data[0].colorscale, gap: d._fullLayout.plot_bgcolor}; })()"
    )
    with Page(tmp_path / "profile") as tab:
        tab.goto(f"{url}/?run={vanilla['id']}&run={raa['id']}")
        tab.wait_for(DRAWN)
        shown = tab.eval(drawn)
        keep(tab.screenshot(tmp_path / "live-page-band.png", full_page=True))
        keep(tab.screenshot(tmp_path / "live-page-band-map.png", element="#maps .map", scale=2))
    expected = [[pytest.approx(position), colour] for position, colour in colour_scale.colorscale(0, 1, t)]
    assert shown["scale"] == expected
    assert threshold_scale(0, 1, t)["colorscale"] == expected
    assert shown["gap"] == colour_scale.GAP


# ---- axes and ticks -----------------------------------------------------------------------------

STEP_AXIS = """((selector) => {
  const div = document.querySelector(selector);
  const ticks = [...div.querySelectorAll('.xtick text')].map((t) => t.textContent);
  return {range: div._fullLayout.xaxis.range, ticks};
})"""


def test_a_run_at_step_0_gets_an_axis_of_whole_steps(collector: LiveCollector, tmp_path: Path) -> None:
    """One report at step 0, and three at steps 0-2: the heatmap and the loss chart span ten steps from half a
    column before step 0, with ticks on whole steps from 0 (not -0.4...0.4, nor 0.5 steps)."""
    need_chromium()
    client = collector.start().client()
    zero, few = first_steps(client, "step0", [0]), first_steps(client, "few", [0, 1, 2])
    with Page(tmp_path / "profile") as tab:
        for run in (zero, few):
            tab.goto(f"{collector.url}/?run={run['id']}")
            tab.wait_for(DRAWN)
            for figure in ("#maps .map", "#loss"):
                axis = tab.eval(f"{STEP_AXIS}({json.dumps(figure)})")
                assert axis["range"] == [-0.5, 9.5], (run["name"], figure, axis)
                assert all(re.fullmatch(r"\d+", tick) for tick in axis["ticks"]), (run["name"], figure, axis)
                ticks = [int(tick) for tick in axis["ticks"]]
                assert ticks[0] == 0 and len(ticks) >= 3 and ticks == sorted(set(ticks)), (run["name"], figure, axis)
            if run is zero:
                keep(tab.screenshot(tmp_path / "live-page-step-0.png", full_page=True))


LABELS_OUTSIDE = """(() => {
  const out = [];
  let checked = 0;
  for (const div of document.querySelectorAll('#maps .map, #latest, #loss')) {
    const box = div.querySelector('.main-svg').getBoundingClientRect();
    const labels = div.querySelectorAll('.xtick text, .ytick text, .cbaxis text, .g-xtitle text, .g-ytitle text');
    for (const label of labels) {
      const r = label.getBoundingClientRect();
      checked += 1;
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
        out.push(`${div.id || 'map'}: "${label.textContent}" at ${[r.left, r.right, r.top, r.bottom].map(Math.round)}`
                 + ` outside ${[box.left, box.right, box.top, box.bottom].map(Math.round)}`);
    }
  }
  return {checked, out};
})()"""
CHART_SIZES = [(1920, 1080), (1400, 900), (1000, 700), (700, 900), (480, 800)]
"""Window sizes: maps side by side at the first three, stacked below 860 px; the charts follow (44vh, 32vh)."""


def test_no_tick_label_is_cut_off_at_any_chart_size(collector: LiveCollector, tmp_path: Path) -> None:
    """Every tick label and axis title of every chart lies inside its chart's box (compared as element bounding
    boxes), at each window size: for the compare view, and for a loss below zero that moves in its fourth
    significant digit (a negative log-likelihood of a density can be that), whose tick labels are the widest."""
    need_chromium()
    client = collector.start().client()
    vanilla, raa = seed(client)
    wide = client.create_run("demo", "wide-ticks", {"n_layers": N_LAYERS})
    steps = [s for s in STEPS if s <= 50]
    client.send_reports(
        wide["id"],
        [r | {"scalars": {"loss": -0.00123 + 2e-7 * s}} for r, s in zip(reports(steps, 0.5, 1.3), steps, strict=True)],
    )
    views = {"compare": f"run={vanilla['id']}&run={raa['id']}", "wide": f"run={wide['id']}"}
    with Page(tmp_path / "profile") as tab:
        for width, height in CHART_SIZES:
            tab.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
            for name, query in views.items():
                tab.goto(f"{collector.url}/?{query}")
                tab.wait_for(DRAWN)
                found = tab.eval(LABELS_OUTSIDE)
                assert found["checked"] >= 30, (width, name, found)
                assert not found["out"], (width, height, name, found["out"])


# ---- fifty runs ---------------------------------------------------------------------------------

RUNS_TABLE = """(() => {
  const scroll = document.getElementById('runs-scroll'), box = scroll.getBoundingClientRect();
  const rows = [...document.querySelectorAll('#runs tbody tr')];
  const last = rows[rows.length - 1].getBoundingClientRect();
  const head = document.querySelector('#runs th').getBoundingClientRect();
  const chips = [...document.querySelectorAll('#chosen .chip')];
  return {top: box.top, bottom: box.bottom, height: box.height, content: scroll.scrollHeight, rows: rows.length,
          first: rows[0].getBoundingClientRect().top, last: last.bottom, head: head.top,
          maps: document.getElementById('maps').getBoundingClientRect().top,
          chips: chips.map((c) => [c.dataset.run, c.getBoundingClientRect().bottom]),
          names: rows.map((r) => r.cells[1].textContent), steps: rows.map((r) => r.cells[3].textContent)};
})()"""


def test_fifty_runs_stay_in_a_bounded_scrolling_table(collector: LiveCollector, tmp_path: Path) -> None:
    """Fifty runs: the table holds them all in a box of at most a quarter of the window that scrolls, its header
    stays in view when scrolled to the end, the maps still start in the window's upper half, the chosen run (the
    oldest, last in the table) stays in view as a chip above it, and the filter and the sortable columns work."""
    need_chromium()
    client = collector.start().client()
    runs = sweep(client, 50)
    oldest = runs[0]
    with Page(tmp_path / "profile", width=1400, height=900) as tab:
        tab.goto(f"{collector.url}/?run={oldest['id']}")
        tab.wait_for(DRAWN)
        table = tab.eval(RUNS_TABLE)
        assert table["rows"] == 50
        assert table["height"] <= 900 / 4 and table["content"] > 3 * table["height"], table
        assert table["maps"] < 900 / 2, table  # no layout blowup: the maps start high on the page
        assert table["names"][-1] == "sweep0/lr-00-warmup-0" and table["last"] > table["bottom"]  # the oldest, below
        assert [run for run, _ in table["chips"]] == [oldest["id"]] and table["chips"][0][1] < table["top"]
        keep(tab.screenshot(tmp_path / "live-page-50-runs.png", full_page=True))

        tab.eval("document.getElementById('runs-scroll').scrollTop = 1e6")
        scrolled = tab.eval(RUNS_TABLE)
        assert abs(scrolled["head"] - scrolled["top"]) <= 2, scrolled  # the sticky header, at the top of the box
        assert scrolled["first"] < scrolled["top"] and scrolled["last"] <= scrolled["bottom"] + 1, scrolled
        keep(tab.screenshot(tmp_path / "live-page-50-runs-scrolled.png", element="#runs-panel", scale=2))

        tab.eval(
            "(() => { const f = document.getElementById('run-filter'); f.value = 'sweep1 LR-4';"
            " f.dispatchEvent(new Event('input')); })()"
        )
        matching = [f"{r['project']}/{r['name']}" for r in runs if r["project"] == "sweep1" and "lr-4" in r["name"]]
        assert tab.eval(RUNS_TABLE)["names"] == matching[::-1] and len(matching) == 4  # newest first, as before
        assert tab.eval("document.getElementById('runs-count').textContent") == "1 of 50 runs chosen, 4 shown"

        tab.eval("document.querySelector('#runs th[data-sort=\"step\"] button').click()")
        assert (
            tab.eval("document.querySelector('#runs th[data-sort=\"step\"]').getAttribute('aria-sort')") == "descending"
        )
        steps = [int(s) for s in tab.eval(RUNS_TABLE)["steps"]]
        assert steps == sorted(steps, reverse=True) and len(set(steps)) > 1

        tab.eval("document.querySelector('#runs tbody tr').click()")  # a row chooses its run
        chosen = tab.wait_for("document.querySelectorAll('#maps .map').length === 2 && location.search")
        assert chosen.startswith(f"?run={oldest['id']}&run=")


def test_tags_show_in_the_runs_table_filter_it_and_notes_stay_text(collector: LiveCollector, tmp_path: Path) -> None:
    """A run's tags are labels after its name and words the filter matches; its notes are the name's tooltip,
    as text: markup in them is never rendered."""
    need_chromium()
    client = collector.start().client()
    tagged = client.create_run(
        "tags", "tagged", {"n_layers": N_LAYERS}, tags=["lr-sweep", "seed:0"], notes="<b>bold?</b> no: text"
    )
    client.create_run("tags", "plain", {"n_layers": N_LAYERS})
    with Page(tmp_path / "profile", width=1400, height=900) as tab:
        tab.goto(collector.url)
        tab.wait_for("document.querySelectorAll('#runs tbody tr').length === 2")
        labels = tab.eval(
            "[...document.querySelectorAll('#runs tbody tr')].map((r) => [r.dataset.run,"
            " [...r.cells[1].querySelectorAll('.tag')].map((s) => s.textContent), r.cells[1].title,"
            " r.cells[1].querySelectorAll('b').length])"
        )
        rows = {run: (tags, title, bold) for run, tags, title, bold in labels}
        assert rows[tagged.id] == (["lr-sweep", "seed:0"], "tags/tagged\n\n<b>bold?</b> no: text", 0)
        tab.eval(
            "(() => { const f = document.getElementById('run-filter'); f.value = 'seed:0';"
            " f.dispatchEvent(new Event('input')); })()"
        )
        shown = tab.eval("[...document.querySelectorAll('#runs tbody tr')].map((r) => r.dataset.run)")
        assert shown == [tagged.id]
