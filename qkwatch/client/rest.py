"""A synchronous Python client of the collector's REST API (httpx only).

Shared by ``qkwatch report``, the CLI and users::

    from qkwatch.client.rest import Client
    with Client() as c:  # $QKWATCH_URL and $QKWATCH_TOKEN, else http://127.0.0.1:8000 and no token
        run = c.create_run("proj", "run-1", config={"n_layers": 24})
        c.send_reports(run.id, [{"step": 0, "time": 0.0, "layers": {"qkai": [0.3] * 24}}])
        c.run("proj/run-1").last_report_at              # a datetime (UTC)
        c.search_runs(project="proj", qkai_above=0.7)   # runs in which some layer's QKAI went above 0.7
        c.tag("proj/run-1", "baseline"); c.search_runs(tags=["baseline"])   # tags, and runs by them
        df = c.history("proj/run-1", metrics=["qkai", "stable_rank"])  # pandas, when installed

A run is named by its id, by ``"project/name"``, or by a :class:`Run` the client returned.

Every answer is parsed with the model the collector's routers declare it with
(:mod:`qkwatch.contract.responses`; here under the names ``Run``, ``Alert``, ``Series``, ...):
frozen, times read as timezone-aware datetimes (UTC) and values as floats, NaN and infinities
decoded from the wire's ``"nan"``/``"inf"``/``"-inf"`` (None: not measured). A list answer is a
:class:`Page` (``data``, ``count``; iterating it gives ``data``). Indexing an answer reads the JSON
the collector sent: ``run["created_at"]`` is epoch seconds, ``series["values"]`` holds ``"nan"``
strings, ``page["data"]`` is a list of dicts. Errors raise :class:`CollectorError`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import httpx

from qkwatch.client.history_grid import HistoryGrid, history_columns, history_frame
from qkwatch.client.runs import RunsMixin, run_ref
from qkwatch.contract import api
from qkwatch.contract.responses import (
    AlertPublic,
    AlertsPublic,
    Answer,
    AuditListPublic,
    AuditPublic,
    ComparePublic,
    CompareSeriesPublic,
    EventPublic,
    HealthPublic,
    HeatmapPublic,
    IngestPublic,
    LambdasPublic,
    MetricsListPublic,
    Page,
    RunPublic,
    SeriesPublic,
)
from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.contract.wire import Report

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
C = TypeVar("C", bound="Client")


class CollectorError(Exception):
    """The collector answered with an error status (or could not be reached: ``status`` 0)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def _message(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return response.text or response.reason_phrase
    if isinstance(detail, list):  # validation errors: name the field of each
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg', '')}" for d in detail)
    return str(detail)


class Client(RunsMixin):
    """Client of one collector. Use as a context manager, or call :meth:`close`.

    This class sends every request (and raises :class:`CollectorError`); the methods on runs
    (create, page, search, change, delete) are :class:`~qkwatch.client.runs.RunsMixin`'s.

    Args:
        base_url: the collector's URL; default ``$QKWATCH_URL``, else ``http://127.0.0.1:8000``.
        token: a bearer token; default ``$QKWATCH_TOKEN``, else none (an ``--open`` collector).
        timeout: seconds per request.
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        base_url = base_url or os.environ.get("QKWATCH_URL") or DEFAULT_URL
        token = token or os.environ.get("QKWATCH_TOKEN") or None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    def close(self) -> None:
        self._http.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        params = kwargs.pop("params", None)
        if params:
            pairs = params.items() if isinstance(params, dict) else params
            kwargs["params"] = [(k, v) for k, v in pairs if v is not None]
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CollectorError(0, f"cannot reach the collector at {self._http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            retry = response.headers.get("retry-after")
            raise CollectorError(response.status_code, _message(response), float(retry) if retry else None)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    # the collector
    def health(self) -> HealthPublic:
        return HealthPublic.of(self._json("GET", "/healthz"))

    def thresholds(self) -> Thresholds:
        """The collector's collapse threshold and H* (``/ui/config.json``, which needs no token).

        Raises:
            CollectorError: as any call; ValueError or KeyError for an answer that does not hold them.
        """
        body = self._json("GET", "/ui/config.json")
        return Thresholds(collapse=float(body["collapse_threshold"]), h_star=float(body["h_star"]))

    def collapse_threshold(self) -> float:
        """The collector's collapse threshold; from a collector without ``/ui/config.json``, this
        machine's ``QKWATCH_COLLAPSE_THRESHOLD`` or the default (``contract.thresholds``), with a warning.

        Raises:
            CollectorError: no collector at all (status 0): the caller fails on that, in one line.
        """
        try:
            return float(self._json("GET", "/ui/config.json")["collapse_threshold"])
        except CollectorError as exc:
            if exc.status == 0:
                raise
            reason: Exception = exc
        except (KeyError, TypeError, ValueError) as exc:
            reason = exc
        fallback = Thresholds.from_env().collapse
        logger.warning("collapse threshold unavailable (%s); using %s", reason, as_text(fallback))
        return fallback

    # ingest
    def send_reports(
        self,
        run: str | RunPublic | dict[str, Any],
        reports: Iterable[Report | dict[str, Any]],
        batch_id: str | None = None,
        attempt: int | None = None,
    ) -> IngestPublic:
        """Send one batch; reuse ``batch_id`` when retrying it, so it is stored once."""
        body = {
            "batch_id": batch_id or str(uuid.uuid4()),
            "attempt": attempt,
            "reports": [r.model_dump(mode="json") if isinstance(r, Report) else r for r in reports],
        }
        return IngestPublic.of(self._json("POST", self._path(api.REPORTS, self._id(run)), json=body))

    # queries
    def series(
        self, run: str | RunPublic | dict[str, Any], metric: str, layer: int = -1, **params: Any
    ) -> SeriesPublic:
        """One layer's values over steps (``layer`` -1: a run-level scalar). params: head, start, end,
        max_points, attempt."""
        return SeriesPublic.of(
            self._json("GET", self._path(api.SERIES, run), params={"metric": metric, "layer": layer, **params})
        )

    def heatmap(self, run: str | RunPublic | dict[str, Any], metric: str = "qkai", **params: Any) -> HeatmapPublic:
        """params: start, end, max_steps, agg ("max", "min", "mean"), head, attempt."""
        return HeatmapPublic.of(self._json("GET", self._path(api.HEATMAP, run), params={"metric": metric, **params}))

    def compare(
        self, runs: Iterable[str | RunPublic | dict[str, Any]], metric: str, layer: int = -1, **params: Any
    ) -> ComparePublic:
        query = [("run", run_ref(r)) for r in runs] + [("metric", metric), ("layer", layer), *params.items()]
        return ComparePublic.of(self._json("GET", api.COMPARE, params=query))

    def history(
        self,
        run: str | RunPublic | dict[str, Any],
        metrics: Iterable[str] | None = None,
        *,
        start: int | None = None,
        end: int | None = None,
        attempt: int | None = None,
        frame: bool | None = None,
    ) -> Any:
        """Every layer value and scalar of ``metrics`` (default: all of the run's) in one call.

        Returns:
            With pandas installed (``pip install 'qkwatch[pandas]'``) or ``frame=True``, a DataFrame
            with columns ``step``, ``layer`` (-1: a run-level scalar) and one per metric, a row per
            (step, layer) that any of them measured, ordered by step and layer; NaN where a metric
            was not measured there, or measured NaN. Without pandas, or with ``frame=False``, the
            same columns as a dict of lists, None where not measured.
        """
        params = [
            ("metrics", ",".join(metrics)) if metrics is not None else ("metrics", None),
            ("start", start),
            ("end", end),
            ("attempt", attempt),
            ("encoding", "f64"),
        ]
        body = self._json("GET", self._path(api.HISTORY, run), params=params)
        if frame is None:
            try:
                import pandas  # noqa: F401
            except ImportError:
                frame = False
            else:
                frame = True
        return history_frame(body) if frame else history_columns(body)

    def export(
        self, run: str | RunPublic | dict[str, Any], format: str = "csv", attempt: int | None = None
    ) -> Iterator[str]:
        """Stream the run's points as lines of CSV (with a header) or JSON."""
        params: dict[str, str | int] = {"format": format, **({"attempt": attempt} if attempt else {})}
        with self._http.stream("GET", self._path(api.EXPORT, run), params=params) as response:
            if response.status_code >= 400:
                response.read()
                raise CollectorError(response.status_code, _message(response))
            yield from response.iter_lines()

    # alerts and lambdas
    def alerts(
        self, run: str | RunPublic | dict[str, Any] | None = None, state: str | None = None, limit: int | None = None
    ) -> AlertsPublic:
        params = {"run": run_ref(run) if run is not None else None, "state": state, "limit": limit}
        return AlertsPublic.of(self._json("GET", api.ALERTS, params=params))

    def lambdas(self, run: str | RunPublic | dict[str, Any]) -> LambdasPublic:
        return LambdasPublic.of(self._json("GET", self._path(api.LAMBDAS, self._id(run))))

    def set_overrides(
        self, run: str | RunPublic | dict[str, Any], overrides: dict[int | str, float | None]
    ) -> LambdasPublic:
        """Set per-layer overrides (None removes one); needs the control scope."""
        return LambdasPublic.of(
            self._json(
                "PUT", self._path(api.LAMBDA_OVERRIDES, self._id(run)), json={str(k): v for k, v in overrides.items()}
            )
        )

    def lambdas_audit(self, run: str | RunPublic | dict[str, Any]) -> AuditListPublic:
        return AuditListPublic.of(self._json("GET", self._path(api.LAMBDA_AUDIT, self._id(run))))


# The client's names of the answers (``from qkwatch.client.rest import Run``): the contract's models.
Alert = AlertPublic
AuditEntry = AuditPublic
Compare = ComparePublic
CompareSeries = CompareSeriesPublic
Event = EventPublic
Health = HealthPublic
Heatmap = HeatmapPublic
Ingested = IngestPublic
Lambdas = LambdasPublic
Result = Answer
Run = RunPublic
RunMetrics = MetricsListPublic
Series = SeriesPublic

__all__ = [
    "Alert",
    "AuditEntry",
    "Client",
    "CollectorError",
    "Compare",
    "CompareSeries",
    "Event",
    "Health",
    "Heatmap",
    "HistoryGrid",
    "Ingested",
    "Lambdas",
    "Page",
    "Result",
    "Run",
    "RunMetrics",
    "Series",
    "history_columns",
    "history_frame",
]
