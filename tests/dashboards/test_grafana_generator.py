"""The committed dashboard files are the generator's output, and the Grafana dashboards hold together.

``python -m qkwatch.dashboards.generate`` writes the Grafana dashboards and provisioning and the Prometheus
rules; with the default thresholds its output is what is committed. What Grafana would only show on
screen is checked here on the JSON: every panel's data source is one the provisioning defines, the
QKAI colours break at the collapse threshold, SQL reads only the qkwatch_*_v views and uses no macro,
and panels do not overlap on the grid. (tests/test_thresholds.py moves the thresholds.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qkwatch.contract import colour_scale
from qkwatch.contract.thresholds import COLLAPSE_THRESHOLD, ENV, Thresholds
from qkwatch.dashboards import generate
from qkwatch.dashboards.grafana.colours import QKAI_EDGES
from qkwatch.dashboards.grafana.queries import iter_queries
from qkwatch.dashboards.push import POSTGRES_UID, PROMETHEUS_UID, load_dashboards
from tests.dashboards.test_grafana_sql import GRAFANA, ROOT, VIEWS

BOARDS = load_dashboards(GRAFANA / "dashboards")
DASHBOARDS = ROOT / "qkwatch" / "dashboards"


def committed_generated_files() -> set[str]:
    """Every file the generator owns: Grafana's JSON and YAML, and the Prometheus rules."""
    grafana = [p for p in GRAFANA.rglob("*") if p.suffix in (".json", ".yml")]
    rules = (DASHBOARDS / "prometheus" / "rules").glob("*.yml")
    return {str(p.relative_to(DASHBOARDS)) for p in [*grafana, *rules]}


def test_committed_files_are_the_generators_output():
    rendered = generate.render(Thresholds())
    assert committed_generated_files() == set(rendered), "the generator and the committed files list different files"
    stale = [rel for rel, text in rendered.items() if (DASHBOARDS / rel).read_text() != text]
    assert not stale, f"stale (run python -m qkwatch.dashboards.generate): {stale}"


def test_generator_check_mode_agrees(capsys, monkeypatch):
    for variable in ENV.values():
        monkeypatch.delenv(variable, raising=False)
    assert generate.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert generate.main(["--check", "--collapse-threshold", "0.65"]) == 1  # other thresholds: other files
    assert "stale: " in capsys.readouterr().out


def test_generator_writes_under_out_and_refuses_a_bad_threshold(tmp_path: Path, capsys):
    assert generate.main(["--out", str(tmp_path), "--h-star", "0.8"]) == 0
    assert generate.main(["--out", str(tmp_path), "--h-star", "0.8", "--check"]) == 0
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()} == committed_generated_files()
    with pytest.raises(SystemExit) as exit_:
        generate.main(["--collapse-threshold", "1.5", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "collapse must be in (0, 1)" in capsys.readouterr().err


def test_the_generator_runs_as_a_module_from_the_repository_root():
    """No sys.path patching: ``python -m qkwatch.dashboards.generate`` finds dashboards and qkwatch from the root."""
    env = {k: v for k, v in os.environ.items() if k not in ENV.values() and k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "qkwatch.dashboards.generate", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "collapse threshold 0.70, h_star 0.85\nup to date" in done.stdout


def test_the_two_dashboards_and_their_data_sources():
    assert {b["uid"]: b["title"] for b in BOARDS} == {"qkwatch-run": "qkwatch / run", "qkwatch-runs": "qkwatch / runs"}
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "qkwatch.yml").read_text())
    uids = {d["uid"] for d in provisioned["datasources"]}
    assert uids == {POSTGRES_UID, PROMETHEUS_UID}
    for board in BOARDS:
        for where, uid, _ in iter_queries(board):
            assert uid in uids, (board["uid"], where)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), board["uid"]
    run = {v["name"]: v for v in BOARDS[0]["templating"]["list"]}
    assert run["run"]["type"] == "query" and run["run"]["datasource"]["uid"] == POSTGRES_UID
    runs = {v["name"] for v in BOARDS[1]["templating"]["list"]}
    assert {"run_a", "run_b"} <= runs


@pytest.mark.parametrize("board", BOARDS, ids=lambda b: b["uid"])
def test_panels_fit_the_grid_without_overlapping(board):
    taken: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells


def qkai_panels(board: dict) -> list[dict]:
    return [
        p
        for p in board["panels"]
        for t in p.get("targets", [])
        if "metric = 'qkai'" in t.get("rawSql", "") or "qkwatch_qkai_ratio" in t.get("expr", "")
    ]


def qkai_colour_steps(panel: dict) -> list[list[dict]]:
    """The threshold steps that colour QKAI values: the panel's own, or an override of a *qkai* column."""
    defaults = panel["fieldConfig"]["defaults"]
    if defaults.get("color", {}).get("mode") == "thresholds" and panel["type"] in ("table", "bargauge"):
        return [defaults["thresholds"]["steps"]]
    return [
        prop["value"]["steps"]
        for o in panel["fieldConfig"]["overrides"]
        if "qkai" in o["matcher"]["options"]
        for prop in o["properties"]
        if prop["id"] == "thresholds"
    ]


@pytest.mark.parametrize("board", BOARDS, ids=lambda b: b["uid"])
def test_qkai_colours_break_at_the_collapse_threshold(board):
    """Every QKAI heatmap, bar gauge and table cell changes colour exactly at the threshold, from the live page's
    calm colours to its alarming ones (``qkwatch.contract.colour_scale``)."""
    coloured = [
        (p["title"], steps)
        for p in qkai_panels(board)
        if p["type"] in ("table", "bargauge")
        for steps in qkai_colour_steps(p)
    ]
    assert len(coloured) >= 2
    for title, steps in coloured:
        values = [s["value"] for s in steps]
        assert COLLAPSE_THRESHOLD in values, title
        assert [(s["value"], s["color"]) for s in steps] == colour_scale.discrete(COLLAPSE_THRESHOLD, QKAI_EDGES), title
    for p in qkai_panels(board):
        if p["type"] in ("timeseries", "trend"):
            steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
            assert [s["value"] for s in steps] == [None, COLLAPSE_THRESHOLD], p["title"]
            assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off", p["title"]


SOURCE = re.compile(r"\b(?:FROM|JOIN)\s+(\w+)\b(?!\s*\()", re.IGNORECASE)
CTE = re.compile(r"(?:\bWITH|,)\s*(\w+)\s+AS\s*\(", re.IGNORECASE)


@pytest.mark.parametrize("board", BOARDS, ids=lambda b: b["uid"])
def test_sql_reads_only_the_views_and_uses_no_macro(board):
    for where, uid, text in iter_queries(board):
        if uid != POSTGRES_UID:
            continue
        assert "$__" not in text, (where, "a macro the tests would have to imitate")
        sources = set(SOURCE.findall(text)) - set(CTE.findall(text))
        assert sources and sources <= set(VIEWS), (where, sources)


@pytest.mark.parametrize("board", BOARDS, ids=lambda b: b["uid"])
def test_trend_panels_get_a_numeric_step_axis(board):
    """Grafana's grouping-to-matrix makes its row field a string named "row\\column": rename it, make it a number."""
    trends = [p for p in board["panels"] if p["type"] == "trend"]
    assert trends
    for p in trends:
        x = p["options"]["xField"]
        steps = [t["id"] for t in p.get("transformations", [])]
        if "groupingToMatrix" not in steps:
            assert re.match(rf"SELECT {x},", p["targets"][0]["rawSql"]), p["title"]  # a plain numeric column
            continue
        assert steps == ["groupingToMatrix", "organize", "convertFieldType"], p["title"]
        matrix, organize, convert = p["transformations"]
        assert organize["options"]["renameByName"] == {f"{matrix['options']['rowField']}\\layer": x}
        assert convert["options"]["conversions"] == [{"targetField": x, "destinationType": "number"}]
