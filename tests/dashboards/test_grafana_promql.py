"""Every PromQL expression of the Grafana dashboards returns data from a real Prometheus scraping a real collector.

The collector (``qkwatch serve``, SQLite) holds a run whose band collapses (tests/dashboards/
conftest.py's ``collapsing_run``); a real Prometheus scrapes it every second. The dashboards'
``$project`` and ``$run_name`` are filled the way Grafana fills them: by the dashboard's own
variable queries, run against the collector's database (the views exist on SQLite too).
"""

from __future__ import annotations

from qkwatch.dashboards.grafana.queries import iter_queries
from qkwatch.dashboards.push import PROMETHEUS_UID, load_dashboards
from qkwatch.monitor.store.engine import make_engine
from tests.dashboards.promstack import query, wait_for_result
from tests.dashboards.test_grafana_sql import GRAFANA, expand, resolve_variables

RATE_INTERVAL = "5s"
"""What Grafana makes of ``$__rate_interval`` at a 1 s scrape interval (at least 4 scrapes)."""


def test_every_promql_expression_returns_data(collector, collapsing_run, start_prometheus):
    run = collapsing_run
    run.collapse()
    prometheus = start_prometheus([run.collector_url])
    wait_for_result(prometheus, f'qkwatch_qkai_ratio{{run="{run.labels["run"]}"}}')
    engine = make_engine(collector.db_url)
    try:
        with engine.connect() as conn:
            boards = [
                (b, resolve_variables(conn, b, {"run": run.run["id"]})) for b in load_dashboards(GRAFANA / "dashboards")
            ]
    finally:
        engine.dispose()
    checked = 0
    for board, values in boards:
        for where, uid, text in iter_queries(board):
            if uid != PROMETHEUS_UID:
                continue
            expr = expand_promql(text, values)
            assert wait_for_result(prometheus, expr, timeout=15), f"{board['title']}, {where}: {expr}"
            checked += 1
    assert checked >= 15
    labels = f'project="{run.labels["project"]}", run="{run.labels["run"]}"'
    assert len(query(prometheus, f"qkwatch_qkai_ratio{{{labels}}}")) == run.n_layers
    assert [float(r["value"][1]) for r in query(prometheus, f"qkwatch_collapsed_layers{{{labels}}}")] == [3]
    assert [float(r["value"][1]) for r in query(prometheus, f"qkwatch_collapse_band_layers{{{labels}}}")] == [3]


def expand_promql(text: str, values: dict[str, tuple[str, str]]) -> str:
    """Grafana's interpolation in a PromQL expression (built-ins such as ``$__rate_interval`` included)."""
    return expand(text.replace("$__rate_interval", RATE_INTERVAL), values)
