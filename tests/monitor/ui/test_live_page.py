"""The live page in a real headless Chromium against a real collector: the compare view draws one
heatmap per run in the URL, titled with the run, on a QKAI colour scale that breaks at the served
collapse threshold; the alerts strip shows the chosen runs' alerts, firing ones in red; the loss
curve is drawn; and the page follows new reports without a reload.

Chromium is Debian's ``/usr/bin/chromium`` (installed by ``.ci/run``); without it the browser tests
skip locally and fail under CI=true. Screenshots are kept under the test's tmp_path and copied to
``$QKWATCH_ARTIFACTS`` when that is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from qkwatch.monitor.main import create_app
from tests.live import ROOT, LiveCollector
from tests.monitor.conftest import make_settings
from tests.monitor.ui.browser import Page, chromium, keep, need_chromium, png_size
from tests.monitor.ui.runs import N_LAYERS, STEPS, VAL_EVERY, reports, seed

FIRING_RED = "rgb(176, 0, 32)"  # #b00020, the strip's firing badge
ENDED_AMBER = "rgb(160, 64, 0)"  # #a04000, the badge of an alert its run ended with
RESOLVED_GREY = "rgb(221, 221, 221)"  # #ddd


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
    assert httpx.get(f"{url}/ui/config.json").json() == {"collapse_threshold": 0.70, "h_star": 0.85}

    shown = figures(compare_dom)

    maps, latest = shown["maps"], shown["latest"]
    assert [m["run"] for m in maps] == [vanilla["id"], raa["id"]]  # the URL's order
    assert [m["heatmaps"] for m in maps] == [1, 1]
    assert "demo/vanilla (running)" in maps[0]["title"]
    assert "3 layers above 0.70: 3, 4, 5" in maps[0]["title"]
    assert "demo/raa (running)" in maps[1]["title"]
    assert "no layer above 0.70" in maps[1]["title"]
    for m in maps:
        # A sharp break: two colour-bar stops at the threshold, dark blue below and light yellow above.
        at = [color for offset, color in m["stops"] if offset == "70%"]
        assert at == ["rgb(8, 48, 107)", "rgb(254, 217, 118)"], m["stops"]
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
    """With the candidate detectors (dashboards/rules/detectors.yml): layer 1's QKAI rises 0.001 per step
    from 0.3 (crossing 0.70 at step 400), layer 2's largest logit jumps to 4x its early value at step 175,
    layer 3's stable rank falls below 1.2 from step 125. The strip shows each alert with the summary that says why; the
    forecast's row names its predicted crossing step."""
    need_chromium()
    rules = ROOT / "dashboards" / "rules" / "detectors.yml"
    with LiveCollector(tmp_path, None, "--rules", str(rules)) as live:
        client = live.client()
        run = client.create_run("demo", "trouble", {"n_layers": 4})
        steps = range(0, 226, 25)
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
    assert "crosses 0.70 in about 200 steps (at step ~400)" in forecast
    assert "layer 2: logit_max 4.0x its early value (20 vs 5;" in shown["logit_growth"]["text"]
    assert "predicted crossing" not in shown["logit_growth"]["text"]


def test_config_is_served_without_a_token_and_follows_the_settings(sqlite_url: str) -> None:
    with TestClient(create_app(make_settings(sqlite_url, collapse_threshold=0.65, h_star=0.8))) as client:
        assert client.get("/v1/runs").status_code == 401
        r = client.get("/ui/config.json")
    assert r.status_code == 200
    assert r.json() == {"collapse_threshold": 0.65, "h_star": 0.8}
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
