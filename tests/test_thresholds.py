"""One home for the collapse threshold and H*: ``qkwatch.contract.thresholds``.

Three things are held here. The module itself (resolution order, validation, how a threshold is
written). Moving the setting moves everything: with ``QKWATCH_COLLAPSE_THRESHOLD=0.65`` and
``QKWATCH_H_STAR=0.80`` the collector's settings, its default alert rules, the schedule's default
H*, ``/metrics``, ``/ui/config.json``, the live page's colour break, ``qkwatch report``, ``qkwatch
analyze``, and the generated Prometheus rules and Grafana dashboards all follow, and none of them
still says 0.70. And no module writes either number as a literal outside thresholds.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from qkwatch.cli import main as qkwatch_main
from qkwatch.contract import colour_scale
from qkwatch.contract.scheduling import ScheduleConfig
from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, ENV, H_STAR, Thresholds, as_text
from qkwatch.dashboards import generate
from qkwatch.monitor.main import load_rules
from qkwatch.monitor.settings import Settings
from qkwatch.rules.ruleset import RuleSet
from tests.conftest import missing_service
from tests.dashboards.promstack import find_binary
from tests.live import ROOT, LiveCollector
from tests.monitor.ui.browser import chromium, need_chromium
from tests.monitor.ui.runs import seed
from tests.monitor.ui.test_live_page import css_rgb, figures

MOVED = Thresholds(collapse=0.65, h_star=0.80)
MOVED_ENV = {ENV["collapse"]: "0.65", ENV["h_star"]: "0.80"}
OLD = re.compile(r"(?<![\w.])0\.70?(?![\d])")
"""0.7 or 0.70 as a number of its own (not 0.705, not 10.7)."""
OLD_H = re.compile(r"(?<![\w.])0\.850?(?![\d])")


@pytest.fixture
def moved_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in MOVED_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)


# ---- the module ---------------------------------------------------------------------------------


def test_defaults_and_the_order_argument_environment_default(clean_env) -> None:
    assert Thresholds() == Thresholds.from_env() == Thresholds(COLLAPSE_THRESHOLD, H_STAR)
    assert Thresholds.from_env(MOVED_ENV) == MOVED
    assert Thresholds.resolve(collapse=0.6, environ=MOVED_ENV) == Thresholds(0.6, 0.80)
    assert Thresholds.resolve(h_star=0.9, environ={ENV["h_star"]: "nonsense"}).h_star == 0.9  # not read
    assert Thresholds.from_env({ENV["collapse"]: "  "}) == Thresholds()  # blank is unset


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"QKWATCH_COLLAPSE_THRESHOLD": "high"}, "QKWATCH_COLLAPSE_THRESHOLD must be a number"),
        ({"QKWATCH_COLLAPSE_THRESHOLD": "1.2"}, "QKWATCH_COLLAPSE_THRESHOLD: collapse must be in (0, 1)"),
        ({"QKWATCH_H_STAR": "nan"}, "QKWATCH_H_STAR: h_star must be a finite number"),
        ({"QKWATCH_H_STAR": "0"}, "QKWATCH_H_STAR: h_star must be in (0, 1)"),
    ],
)
def test_a_bad_variable_is_named(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        Thresholds.from_env(environ)
    assert needle in str(err.value)


def test_a_bad_argument_is_named() -> None:
    with pytest.raises(ValueError, match=r"^collapse: collapse must be in \(0, 1\)"):
        Thresholds.resolve(collapse=1.0, environ={})
    with pytest.raises(ValueError, match="h_star must be a finite number"):
        Thresholds(h_star=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "text"), [(0.7, "0.70"), (0.65, "0.65"), (0.8, "0.80"), (0.725, "0.725")])
def test_a_threshold_is_written_without_rounding(value: float, text: str) -> None:
    assert as_text(value) == text and float(text) == value


def test_the_collector_settings_read_the_same_variables(clean_env, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().thresholds == Thresholds()
    assert {"collapse_threshold", "h_star"} <= set(Settings.model_fields)  # env prefix QKWATCH_
    assert set(ENV.values()) == {"QKWATCH_COLLAPSE_THRESHOLD", "QKWATCH_H_STAR"}
    monkeypatch.setenv(ENV["h_star"], "1.5")
    with pytest.raises(ValueError, match="h_star"):
        Settings()


# ---- moving the setting moves everything ---------------------------------------------------------


def test_moved_settings_alert_rules_and_schedule(moved_env, tmp_path: Path) -> None:
    settings = Settings()
    assert settings.thresholds == MOVED
    (rule,) = load_rules(settings).thresholds
    assert (rule.name, rule.threshold) == ("qkai_high", 0.65)
    assert rule.describe() == "qkai > 0.65 for 3 consecutive reports"
    path = tmp_path / "rules.yaml"  # a rules file whose qkai rule leaves the threshold to the setting
    path.write_text(yaml.safe_dump({"rules": [{"name": "hot", "metric": "qkai", "for_reports": 2}]}))
    assert [r.threshold for r in load_rules(Settings(alert_rules_file=path)).thresholds] == [0.65]
    assert RuleSet.default().thresholds[0].threshold == COLLAPSE_THRESHOLD  # the pure default stays the constant
    assert ScheduleConfig().h_star == 0.80
    assert ScheduleConfig.from_mapping(None).h_star == 0.80
    assert ScheduleConfig.from_mapping({"h_star": 0.9}).h_star == 0.9  # a run's own H* still wins


def test_moved_generated_prometheus_rules(tmp_path: Path) -> None:
    """``python -m qkwatch.dashboards.generate`` from the repository root, thresholds from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.dashboards.generate", "--out", str(tmp_path)],
        cwd=ROOT,
        env={**env, **MOVED_ENV},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "collapse threshold 0.65, h_star 0.80" in done.stdout
    files = generate.render(MOVED)
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()} == set(files)
    assert all((tmp_path / rel).read_text() == text for rel, text in files.items())

    text = files["prometheus/rules/qkwatch.yml"]
    assert not OLD.search(text), OLD.search(text)
    rules = {r["alert"]: r for g in yaml.safe_load(text)["groups"] for r in g["rules"]}
    assert rules["QkwatchQkaiHigh"]["expr"].startswith("qkwatch_qkai_ratio > 0.65 unless ")
    assert "has been above 0.65 (collapse)" in rules["QkwatchQkaiHigh"]["annotations"]["description"]
    band = rules["QkwatchCollapseBand"]["annotations"]
    assert band["summary"].endswith("above QKAI 0.65")
    assert 'qkwatch_qkai_ratio{project=%q,run=%q} > 0.65" $labels' in band["description"]

    promtool = find_binary("promtool") or missing_service("promtool is not installed (apt-get install prometheus)")
    checked = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "prometheus/rules/qkwatch.yml")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def strings(node: Any) -> Iterator[str]:
    """Every string in a JSON document (titles, descriptions, SQL, PromQL)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def titled(board: dict[str, Any], title: str) -> dict[str, Any]:
    (panel,) = [p for p in board["panels"] if p["title"] == title]
    return panel


def step_values(panel: dict[str, Any]) -> list[float | None]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_moved_grafana_dashboards() -> None:
    files = generate.render(MOVED)
    run, runs = (json.loads(files[f"grafana/dashboards/{n}.json"]) for n in ("run", "runs"))
    for board in (run, runs):
        text = files[f"grafana/dashboards/{'run' if board is run else 'runs'}.json"]
        assert not OLD.search(text.replace('"groupWidth": 0.7', "")), OLD.search(text)  # a bar width, not QKAI
        assert not [s for s in strings(board) if OLD_H.search(s)]
    # thresholds: the QKAI colours break at 0.65, the entropy colours at 0.80; the trend lines sit there
    heatmap = titled(run, "QKAI per layer and step (orange to red above 0.65)")
    assert 0.65 in step_values(heatmap) and 0.7 not in step_values(heatmap)
    entropy = titled(run, "Attention entropy per layer and step (orange above h_star 0.80)")
    assert 0.80 in step_values(entropy) and 0.85 not in step_values(entropy)
    assert step_values(titled(run, "QKAI")) == step_values(titled(run, "QKAI per layer")) == [None, 0.65]
    assert step_values(titled(run, "Attention entropy")) == [None, 0.80]
    assert step_values(titled(run, "Attention entropy per layer")) == [None, 0.80]
    # titles, descriptions and the SQL that counts layers above the threshold
    assert titled(run, "Layers above 0.65")["description"]
    assert "breaking at 0.65" in titled(run, "QKAI per layer, latest")["description"]
    assert "h_star (0.80)" in titled(run, "Attention entropy")["description"]
    assert "exceeds 0.65 on 3 or more" in titled(runs, "Runs with a collapse band")["description"]
    assert sum("value > 0.65" in s for s in strings(runs)) == 2


@pytest.fixture(scope="module")
def moved_collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict, dict]]:
    """A real ``qkwatch serve`` started with the moved thresholds in its environment, holding the page's two runs."""
    with LiveCollector(tmp_path_factory.mktemp("collector"), env=MOVED_ENV) as live:
        vanilla, raa = seed(live.client())
        yield live.url, vanilla, raa


def test_moved_collector_config_metrics_and_alerts(moved_collector) -> None:
    url, vanilla, _ = moved_collector
    config = httpx.get(f"{url}/ui/config.json").json()
    drawn_with = {k: config[k] for k in ("collapse_threshold", "h_star", "colour_scale")}  # the rest: the catalogue
    assert drawn_with == {"collapse_threshold": 0.65, "h_star": 0.80, "colour_scale": colour_scale.as_json()}
    metrics = httpx.get(f"{url}/metrics").text
    assert "# HELP qkwatch_collapsed_layers Layers whose latest qkai exceeds 0.65." in metrics
    assert 'qkwatch_collapsed_layers{project="demo",run="vanilla"} 3.0' in metrics
    alerts = httpx.get(f"{url}/v1/alerts", params={"run": vanilla["id"]}).json()["data"]
    summaries = [a["summary"] for a in alerts if a["rule"] == "qkai_high"]
    assert len(summaries) == 3 and all("qkai > 0.65 for 3 consecutive reports" in s for s in summaries)


def test_moved_live_page_breaks_its_colours_at_the_served_threshold(moved_collector, tmp_path: Path) -> None:
    need_chromium()
    url, vanilla, _ = moved_collector
    shown = figures(chromium(f"{url}/?run={vanilla['id']}", tmp_path / "profile", "--dump-dom"))
    (qkai,) = shown["maps"]
    assert "3 layers above 0.65: 3, 4, 5" in qkai["title"]
    at = [color for offset, color in qkai["stops"] if offset == "65%"]
    assert at == [css_rgb(colour_scale.BELOW[-1]), css_rgb(colour_scale.ABOVE[0])], qkai["stops"]  # calm, then alarm
    assert "<b>0.65 collapse</b>" in qkai["texts"] and "collapse 0.65" in shown["latest"]["texts"]
    drawn = [qkai["title"], *qkai["texts"], shown["latest"]["title"], *shown["latest"]["texts"]]
    assert not [t for t in drawn if OLD.search(t)]


def test_moved_report(moved_collector, tmp_path: Path) -> None:
    url, _, _ = moved_collector
    out = tmp_path / "report.html"
    assert qkwatch_main(["report", "demo/vanilla", "--url", url, "--out", str(out)]) == 0
    doc = out.read_text()
    assert "collapse threshold 0.65</div>" in doc
    assert "layers above 0.65 (latest qkai)" in doc
    assert "0.65 collapse" in doc and "collapse 0.65" in doc  # the colour bar's break and the latest figure's line
    library = max(re.findall(r"<script[^>]*>.*?</script>", doc, re.S), key=len)  # plotly.js itself
    assert not OLD.search(doc.replace(library, "")), OLD.search(doc.replace(library, ""))


def test_moved_report_fallback_without_the_collectors_config(moved_env, monkeypatch: pytest.MonkeyPatch) -> None:
    from qkwatch.client.rest import Client, CollectorError

    def no_config(*args: object, **kwargs: object) -> object:
        raise CollectorError(404, "not found")

    monkeypatch.setattr(Client, "_json", no_config)
    with Client("http://127.0.0.1:9") as client:
        assert client.collapse_threshold() == 0.65


def two_layer_checkpoint(path: Path) -> Path:
    """4 heads of d_head 2 in d_model 8, all alike: QKAI = cos^2 of both principal angles, 0.675 and 0.5."""
    state = {}
    for layer, qkai in enumerate((0.675, 0.5)):
        c, s = qkai**0.5, (1 - qkai) ** 0.5
        wq, wk = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)  # (head, d_head, d_model)
        for j in range(2):
            wq[:, j, j] = 1.0
            wk[:, j, j], wk[:, j, 2 + j] = c, s
        state[f"net.{layer}.wq.weight"], state[f"net.{layer}.wk.weight"] = wq.reshape(8, 8), wk.reshape(8, 8)
    torch.save(state, path)
    return path


def test_moved_analyze_highlight(moved_env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["analyze", str(two_layer_checkpoint(tmp_path / "m.pt")), "--no-spectra", "--n-heads", "4"]
    args += ["--q-key", "net.{i}.wq.weight", "--k-key", "net.{i}.wk.weight"]
    assert qkwatch_main(args) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "red: QKAI > 0.65" in shown and "QKAI above 0.65 in layers 0" in shown
    assert not OLD.search(shown)
    assert qkwatch_main([*args, "--collapse-threshold", "0.7"]) == 0  # the argument wins: 0.675 is not above
    assert "QKAI above" not in capsys.readouterr().out


# ---- no literal elsewhere -----------------------------------------------------------------------

LITERAL_VALUES = {COLLAPSE_THRESHOLD, H_STAR}
LITERAL_TEXT = re.compile(r"(?<![\w.])0?\.(?:70*|850*)(?![\w%])")  # not 0.705, 10.7, 0.85rem
HOME = "qkwatch/contract/thresholds.py"
ALLOWED = {
    ("qkwatch/dashboards/grafana/runs_board.py", '"groupWidth": 0.7'): "a bar chart's width, a fraction of its slot",
}
"""(file, text of the line): uses of 0.7 or 0.85 that mean neither the threshold nor H*."""


def python_sources() -> list[Path]:
    found = [
        p for name in ("monitor", "agent", "dashboards", "contract") for p in (ROOT / "qkwatch" / name).rglob("*.py")
    ]
    return sorted([*found, *(ROOT / "qkwatch").glob("*.py")])


def literals(path: Path) -> Iterator[int]:
    """Line numbers of 0.7/0.85 in code: numbers, and strings other than docstrings (prose may cite them)."""
    tree = ast.parse(path.read_text())
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in prose and is_literal(node.value):
            yield node.lineno


def is_literal(value: object) -> bool:
    if isinstance(value, float):
        return value in LITERAL_VALUES
    return isinstance(value, str) and LITERAL_TEXT.search(value) is not None


def stray(rel: str, line: str) -> bool:
    return not any(rel == where and text in line for where, text in ALLOWED)


def test_no_module_writes_the_threshold_or_h_star_but_thresholds_py() -> None:
    found = []
    for path in python_sources():
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        found += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in literals(path) if stray(rel, lines[n - 1])]
    for rel in ("qkwatch/monitor/ui/page.html", "qkwatch/dashboards/prometheus/qkwatch.yml.template"):
        lines = (ROOT / rel).read_text().splitlines()
        found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if LITERAL_TEXT.search(line)]
    assert not [f for f in found if not f.startswith(HOME)], "use qkwatch.contract.thresholds:\n" + "\n".join(found)
    for where, text in ALLOWED:  # an entry that no longer matches anything goes
        assert text in (ROOT / where).read_text(), f"ALLOWED: {where} has no {text!r} any more"
    assert len(list(literals(ROOT / HOME))) == 2  # the home itself: COLLAPSE_THRESHOLD and H_STAR


def test_the_literal_finder_finds_numbers_and_strings_but_not_prose(tmp_path: Path) -> None:
    code = tmp_path / "m.py"
    code.write_text('"""At 0.70 a layer collapses."""\nX = 0.7\nY = f"above {X} or 0.85"\nZ = 0.705\n')
    assert list(literals(code)) == [2, 3]
