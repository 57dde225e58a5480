"""A synchronous Python client of the collector's REST API (httpx only).

Shared by ``qkwatch report``, the CLI and users::

    from qkwatch.monitor.client import Client
    with Client() as c:  # $QKWATCH_URL and $QKWATCH_TOKEN, else http://127.0.0.1:8000 and no token
        run = c.create_run("proj", "run-1", config={"n_layers": 24})
        c.send_reports(run.id, [{"step": 0, "time": 0.0, "layers": {"qkai": [0.3] * 24}}])
        c.run("proj/run-1").last_report_at              # a datetime (UTC)
        c.search_runs(project="proj", qkai_above=0.7)   # runs in which some layer's QKAI went above 0.7
        c.tag("proj/run-1", "baseline"); c.search_runs(tags=["baseline"])   # tags, and runs by them
        df = c.history("proj/run-1", metrics=["qkai", "stable_rank"])  # pandas, when installed

A run is named by its id, by ``"project/name"``, or by a :class:`Run` the client returned.

Results are typed (``monitor.results``, re-exported here): frozen dataclasses whose times are
timezone-aware datetimes (UTC) and whose values are floats, NaN and infinities decoded from the
wire's ``"nan"``/``"inf"``/``"-inf"`` (None: not measured). A list answer is a :class:`Page`
(``data``, ``count``; iterating it gives ``data``). Indexing a result reads the JSON the collector
sent, as the client returned it before it was typed: ``run["created_at"]`` is epoch seconds,
``series["values"]`` holds ``"nan"`` strings, ``page["data"]`` is a list of dicts. Errors raise
:class:`CollectorError`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from qkwatch.contract.thresholds import Thresholds, as_text
from qkwatch.contract.wire import Report
from qkwatch.monitor.results import (
    Alert,
    AuditEntry,
    Compare,
    CompareSeries,
    Event,
    Health,
    Heatmap,
    HistoryGrid,
    Ingested,
    Lambdas,
    Page,
    Result,
    Run,
    RunMetrics,
    Series,
    history_columns,
    history_frame,
)

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


# ---- the client ------------------------------------------------------------------------------------


def _ref(run: str | Result | dict[str, Any]) -> str:
    """A run argument -> the id or ``project/name`` it names."""
    return run["id"] if isinstance(run, (Result, dict)) else str(run)


def _tags(tags: Iterable[str]) -> list[str]:
    """Tags as the API takes them: a list; a single string is one tag, not its characters."""
    return [tags] if isinstance(tags, str) else list(tags)


def _when(t: datetime | float | str | None) -> float | str | None:
    """A time filter as the API takes it: epoch seconds or ISO 8601 (the API reads a naive time as UTC)."""
    return t.isoformat() if isinstance(t, datetime) else t


class Client:
    """Client of one collector. Use as a context manager, or call :meth:`close`.

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

    @staticmethod
    def _path(run: str | Run | dict[str, Any], suffix: str = "") -> str:
        """``/v1/runs/<run>``: ``project/name`` travels with its slash encoded (``%2F``)."""
        return f"/v1/runs/{quote(_ref(run), safe='')}{suffix}"

    def _id(self, run: str | Run | dict[str, Any]) -> str:
        """The run's id; ``project/name`` is looked up (the ingest and lambda routes take ids only)."""
        ref = _ref(run)
        return self.run(ref).id if "/" in ref else ref

    # runs
    def health(self) -> Health:
        return Health.of(self._json("GET", "/healthz"))

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

    def create_run(
        self,
        project: str,
        name: str,
        config: dict[str, Any] | None = None,
        attempt_key: str | None = None,
        *,
        tags: Iterable[str] = (),
        notes: str | None = None,
    ) -> Run:
        """Create or resume a run; the answer's ``attempt`` is the attempt to report under.

        ``tags`` are added to the run's (a resume never removes one); ``notes`` are stored when the
        run has none (change them with :meth:`update_run`).
        """
        body: dict[str, Any] = {"project": project, "name": name, "config": config or {}, "attempt_key": attempt_key}
        if tags:
            body["tags"] = _tags(tags)
        if notes is not None:
            body["notes"] = notes
        return Run.of(self._json("POST", "/v1/runs", json=body))

    def runs(
        self,
        project: str | None = None,
        status: str | None = None,
        name: str | None = None,
        limit: int = 100,
        offset: int = 0,
        *,
        tags: Iterable[str] = (),
        **filters: Any,
    ) -> Page[Run]:
        """One page of runs, latest activity first; ``tags`` and ``filters`` as in :meth:`search_runs`."""
        params = [
            ("project", project),
            ("status", status),
            ("name", name),
            ("limit", limit),
            ("offset", offset),
            *(("tag", tag) for tag in _tags(tags)),
            *self._filters(**filters).items(),
        ]
        return Page.of(self._json("GET", "/v1/runs", params=params), Run)

    def search_runs(
        self,
        project: str | None = None,
        *,
        status: str | None = None,
        name: str | None = None,
        tags: Iterable[str] = (),
        qkai_above: float | None = None,
        qkai_latest_above: float | None = None,
        collapse_band: bool | None = None,
        alert: str | None = None,
        created_after: datetime | float | str | None = None,
        created_before: datetime | float | str | None = None,
        updated_after: datetime | float | str | None = None,
        updated_before: datetime | float | str | None = None,
        max_results: int = 1000,
    ) -> list[Run]:
        """Runs by what happened in them, latest activity first (all pages, up to ``max_results``).

        Args:
            tags: runs that have every one of these tags (``["baseline", "lr=3e-4"]``).
            qkai_above: some layer's QKAI was above this at some report (any step, any attempt);
                MLflow's ``search_runs("metrics.qkai > 0.7")`` compares the latest value instead,
                which is ``qkai_latest_above``.
            collapse_band: True: runs that have had a collapse band alert (firing or resolved);
                False: runs that never had one.
            alert: runs that have had an alert of this rule (e.g. ``"qkai_high"``).
            created_after, created_before, updated_after, updated_before: datetimes (naive = UTC),
                epoch seconds or ISO 8601 strings; inclusive.
        """
        filters = self._filters(
            qkai_above=qkai_above,
            qkai_latest_above=qkai_latest_above,
            collapse_band=collapse_band,
            alert=alert,
            created_after=created_after,
            created_before=created_before,
            updated_after=updated_after,
            updated_before=updated_before,
        )
        out: list[Run] = []
        while len(out) < max_results:
            page = self.runs(
                project=project,
                status=status,
                name=name,
                limit=min(1000, max_results - len(out)),
                offset=len(out),
                tags=tags,
                **filters,
            )
            out += page.data
            if not page.data or len(out) >= page.count:
                break
        return out

    @staticmethod
    def _filters(**filters: Any) -> dict[str, Any]:
        out = {}
        for key, value in filters.items():
            if isinstance(value, bool):
                value = str(value).lower()
            elif key.endswith(("_after", "_before")):
                value = _when(value)
            out[key] = value
        return out

    def run(self, run: str | Run | dict[str, Any]) -> Run:
        return Run.of(self._json("GET", self._path(run)))

    def set_status(
        self, run: str | Run | dict[str, Any], status: str, reason: str | None = None, attempt: int | None = None
    ) -> Run:
        """Say how the run ended ("finished", "crashed"); ``reason`` is stored as ``status_reason``."""
        body = {"status": status, "reason": reason, "attempt": attempt}
        return Run.of(self._json("PATCH", self._path(run), json={k: v for k, v in body.items() if v is not None}))

    def update_run(
        self,
        run: str | Run | dict[str, Any],
        *,
        tags: Iterable[str] | None = None,
        add_tags: Iterable[str] | None = None,
        remove_tags: Iterable[str] | None = None,
        notes: str | None = None,
    ) -> Run:
        """Change the run's tags and notes (an ``ingest`` or ``control`` token), all or nothing.

        Args:
            tags: the run's tags from now on (``[]``: none).
            add_tags, remove_tags: tags to add and to remove, the others kept (not with ``tags``).
            notes: the run's notes from now on (``""``: none); None leaves them as they are.
        """
        body: dict[str, Any] = {"notes": notes} if notes is not None else {}
        for key, value in (("tags", tags), ("add_tags", add_tags), ("remove_tags", remove_tags)):
            if value is not None:
                body[key] = _tags(value)
        return Run.of(self._json("PATCH", self._path(run), json=body))

    def tag(self, run: str | Run | dict[str, Any], *tags: str) -> Run:
        """Add ``tags`` to the run (those it has are kept)."""
        return self.update_run(run, add_tags=tags)

    def untag(self, run: str | Run | dict[str, Any], *tags: str) -> Run:
        """Remove ``tags`` from the run (one it lacks is fine)."""
        return self.update_run(run, remove_tags=tags)

    def delete_run(self, run: str | Run | dict[str, Any]) -> None:
        self._request("DELETE", self._path(run))

    def events(
        self,
        run: str | Run | dict[str, Any],
        kind: str | None = None,
        attempt: int | None = None,
        limit: int | None = None,
    ) -> Page[Event]:
        return Page.of(
            self._json("GET", self._path(run, "/events"), params={"kind": kind, "attempt": attempt, "limit": limit}),
            Event,
        )

    def metrics(self, run: str | Run | dict[str, Any]) -> RunMetrics:
        """The metrics the run reported, each with its layers."""
        return RunMetrics.of(self._json("GET", self._path(run, "/metrics")))

    # ingest
    def send_reports(
        self,
        run: str | Run | dict[str, Any],
        reports: Iterable[Report | dict[str, Any]],
        batch_id: str | None = None,
        attempt: int | None = None,
    ) -> Ingested:
        """Send one batch; reuse ``batch_id`` when retrying it, so it is stored once."""
        body = {
            "batch_id": batch_id or str(uuid.uuid4()),
            "attempt": attempt,
            "reports": [r.model_dump(mode="json") if isinstance(r, Report) else r for r in reports],
        }
        return Ingested.of(self._json("POST", self._path(self._id(run), "/reports"), json=body))

    # queries
    def series(self, run: str | Run | dict[str, Any], metric: str, layer: int = -1, **params: Any) -> Series:
        """One layer's values over steps (``layer`` -1: a run-level scalar). params: head, start, end,
        max_points, attempt."""
        return Series.of(
            self._json("GET", self._path(run, "/series"), params={"metric": metric, "layer": layer, **params})
        )

    def heatmap(self, run: str | Run | dict[str, Any], metric: str = "qkai", **params: Any) -> Heatmap:
        """params: start, end, max_steps, agg ("max", "min", "mean"), head, attempt."""
        return Heatmap.of(self._json("GET", self._path(run, "/heatmap"), params={"metric": metric, **params}))

    def compare(
        self, runs: Iterable[str | Run | dict[str, Any]], metric: str, layer: int = -1, **params: Any
    ) -> Compare:
        query = [("run", _ref(r)) for r in runs] + [("metric", metric), ("layer", layer), *params.items()]
        return Compare.of(self._json("GET", "/v1/compare", params=query))

    def history(
        self,
        run: str | Run | dict[str, Any],
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
        body = self._json("GET", self._path(run, "/history"), params=params)
        if frame is None:
            try:
                import pandas  # noqa: F401
            except ImportError:
                frame = False
            else:
                frame = True
        return history_frame(body) if frame else history_columns(body)

    def export(self, run: str | Run | dict[str, Any], format: str = "csv", attempt: int | None = None) -> Iterator[str]:
        """Stream the run's points as lines of CSV (with a header) or JSON."""
        params: dict[str, str | int] = {"format": format, **({"attempt": attempt} if attempt else {})}
        with self._http.stream("GET", self._path(run, "/export"), params=params) as response:
            if response.status_code >= 400:
                response.read()
                raise CollectorError(response.status_code, _message(response))
            yield from response.iter_lines()

    # alerts and lambdas
    def alerts(
        self, run: str | Run | dict[str, Any] | None = None, state: str | None = None, limit: int | None = None
    ) -> Page[Alert]:
        params = {"run": _ref(run) if run is not None else None, "state": state, "limit": limit}
        return Page.of(self._json("GET", "/v1/alerts", params=params), Alert)

    def lambdas(self, run: str | Run | dict[str, Any]) -> Lambdas:
        return Lambdas.of(self._json("GET", self._path(self._id(run), "/lambdas")))

    def set_overrides(self, run: str | Run | dict[str, Any], overrides: dict[int | str, float | None]) -> Lambdas:
        """Set per-layer overrides (None removes one); needs the control scope."""
        return Lambdas.of(
            self._json(
                "PUT", self._path(self._id(run), "/lambdas/overrides"), json={str(k): v for k, v in overrides.items()}
            )
        )

    def lambdas_audit(self, run: str | Run | dict[str, Any]) -> Page[AuditEntry]:
        return Page.of(self._json("GET", self._path(self._id(run), "/lambdas/audit")), AuditEntry)


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
