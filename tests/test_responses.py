"""The API's answers live once, in ``qkwatch.contract.responses``: the collector's routes declare them,
the client parses with the very same classes, and an answer reads back as it was written."""

from __future__ import annotations

import inspect
import math
import typing
from datetime import datetime, timezone
from pathlib import Path

from fastapi.routing import APIRoute

from qkwatch.client import rest
from qkwatch.contract import api, responses
from qkwatch.contract.answer_base import Answer
from qkwatch.monitor.api import alerts, lambdas, queries, reports, runs
from qkwatch.monitor.main import create_app
from qkwatch.monitor.settings import Settings

CLIENT_NAMES = {
    "Alert": responses.AlertPublic,
    "AuditEntry": responses.AuditPublic,
    "Compare": responses.ComparePublic,
    "CompareSeries": responses.CompareSeriesPublic,
    "Event": responses.EventPublic,
    "Health": responses.HealthPublic,
    "Heatmap": responses.HeatmapPublic,
    "Ingested": responses.IngestPublic,
    "Lambdas": responses.LambdasPublic,
    "Page": responses.Page,
    "Result": responses.Answer,
    "Run": responses.RunPublic,
    "RunMetrics": responses.MetricsListPublic,
    "Series": responses.SeriesPublic,
}
"""The names the client's results had before they were the contract's (docs and users import them)."""


def route_models(tmp_path: Path) -> dict[str, type]:
    """``METHOD path`` -> the response model the collector declares for it (the API's routers, and
    the app's own ``/healthz``)."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'collector.db'}", auto_migrate=False, background=False)
    routes = [
        *create_app(settings).routes,
        *(r for m in (alerts, lambdas, queries, reports, runs) for r in m.router.routes),
    ]
    found = {
        f"{method} {route.path}": route.response_model
        for route in routes
        if isinstance(route, APIRoute) and route.response_model is not None
        for method in route.methods
    }
    assert {key.split(" ")[1] for key in found} >= set(api.ROUTES) - {api.EXPORT}  # export streams CSV or JSON lines
    return found


def client_models() -> dict[str, type]:
    """Each method of the client that returns an answer -> the class it parses the answer with."""
    found = {}
    for name, method in inspect.getmembers(rest.Client, inspect.isfunction):
        returned = typing.get_type_hints(method).get("return")
        returned = typing.get_args(returned)[0] if typing.get_origin(returned) is list else returned
        if inspect.isclass(returned) and issubclass(returned, Answer):
            found[name] = returned
    return found


def test_every_route_declares_a_model_of_the_contract(tmp_path: Path) -> None:
    models = route_models(tmp_path)
    assert {"GET /v1/runs", "POST /v1/runs/{run_id}/reports", "GET /v1/alerts", "GET /healthz"} <= models.keys()
    for route, model in models.items():
        assert model.__module__ == responses.__name__, route
        assert getattr(responses, model.__name__) is model, route


def test_the_client_parses_with_the_classes_the_routes_declare(tmp_path: Path) -> None:
    declared = set(route_models(tmp_path).values())
    parsed = client_models()
    assert parsed["run"] is responses.RunPublic and parsed["search_runs"] is responses.RunPublic
    assert parsed["alerts"] is responses.AlertsPublic and parsed["series"] is responses.SeriesPublic
    assert set(parsed.values()) <= declared
    # Every answer the collector declares is parsed by the client, but the history, which the client
    # reads as columns (qkwatch.client.history_grid) rather than as one object.
    assert declared - set(parsed.values()) == {responses.HistoryPublic}


def test_the_client_names_are_the_contract_classes() -> None:
    for name, cls in CLIENT_NAMES.items():
        assert getattr(rest, name) is cls, name
        assert name in rest.__all__


def test_an_alert_reads_back_as_the_collector_wrote_it() -> None:
    """Times keep every bit of their epoch seconds (a datetime would round them to the microsecond),
    values go back to the wire's spelling, and the client's reading of the JSON is typed."""
    starts = 1767225600.1234567  # not a whole microsecond
    written = responses.AlertPublic(
        id=7,
        run="r1",
        run_name="run",
        project="p",
        rule="qkai_high",
        severity="warning",
        state="ended",
        metric="qkai",
        layers=[0, 1, 2],
        summary="s",
        onset_step=10,
        resolved_step=None,
        starts_at=starts,
        ends_at=None,
        ended_step=30,
        run_end="crashed",
        last_values=[math.inf, math.nan, 0.5],
    )
    sent = written.model_dump(mode="json", by_alias=True)
    assert sent["starts_at"] == starts and sent["last_values"] == ["inf", "nan", 0.5]
    assert sent["starts_at_iso"] == "2026-01-01T00:00:00.123+00:00" and sent["ends_at_iso"] is None
    read = responses.AlertPublic.of(sent)
    assert read == written and read.raw is sent and read["starts_at"] == starts
    assert read.starts_at == datetime.fromtimestamp(starts, timezone.utc) and read.ended_while_firing
    assert read.last_values is not None and read.last_values[0] == math.inf and math.isnan(read.last_values[1])


def test_an_event_time_no_calendar_holds_travels_and_reads_as_none() -> None:
    event = responses.EventPublic(attempt=1, step=0, kind="note", message="", data={}, time=1e300)
    sent = event.model_dump(mode="json", by_alias=True)
    assert sent["time"] == 1e300 and sent["time_iso"] is None
    assert responses.EventPublic.of(sent).time is None


def test_a_page_iterates_its_items_and_indexes_its_json() -> None:
    run = {
        "id": "r1",
        "project": "p",
        "name": "n",
        "status": "running",
        "status_reason": None,
        "attempt": 1,
        "latest_attempt": 1,
        "config": {},
        "created_at": 1.0,
        "updated_at": 2.0,
        "last_report_at": None,
        "last_step": None,
    }  # a collector older than tags and notes
    page = responses.RunsPublic.of({"data": [run], "count": 3})
    (only,) = page
    assert isinstance(page, responses.Page) and len(page) == 1 and page.count == 3
    assert only.raw is run and page["data"][0] is run and page[0] is only
    assert (only.tags, only.notes, only.ref, only.last_report_at) == ((), None, "p/n", None)
    assert dict(only) == run and only.updated_at == datetime.fromtimestamp(2.0, timezone.utc)
