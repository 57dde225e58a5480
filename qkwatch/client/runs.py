"""The runs resource of :class:`~qkwatch.client.rest.Client`, and how a run is named in a request.

A run is named by its id, by ``"project/name"``, or by a :class:`~qkwatch.contract.responses.RunPublic` the
client returned (:func:`run_ref`). :class:`RunsMixin` holds what the client does to runs (create or
resume, page and search, change tags, notes and status, delete, read events and metrics); the
transport it sends them through, and the errors it raises, are the client's own
(:mod:`qkwatch.client.rest`), which keeps httpx in one module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from qkwatch.contract import api
from qkwatch.contract.responses import Answer, EventsPublic, MetricsListPublic, RunPublic, RunsPublic


def run_ref(run: str | Answer | dict[str, Any]) -> str:
    """A run argument -> the id or ``project/name`` it names."""
    return run["id"] if isinstance(run, (Answer, dict)) else str(run)


def _tags(tags: Iterable[str]) -> list[str]:
    """Tags as the API takes them: a list; a single string is one tag, not its characters."""
    return [tags] if isinstance(tags, str) else list(tags)


def _when(t: datetime | float | str | None) -> float | str | None:
    """A time filter as the API takes it: epoch seconds or ISO 8601 (the API reads a naive time as UTC)."""
    return t.isoformat() if isinstance(t, datetime) else t


class RunsMixin(ABC):
    """The runs methods of :class:`~qkwatch.client.rest.Client`, which sends their requests.

    A mixin, so that the client keeps one flat API (``c.create_run``, ``c.search_runs``, ``c.tag``)
    while its requests on runs live apart from its transport.
    """

    @abstractmethod
    def _request(self, method: str, path: str, **kwargs: Any) -> object:
        """Send one request; an error status raises :class:`~qkwatch.client.rest.CollectorError`."""

    @abstractmethod
    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and decode its JSON answer."""

    @staticmethod
    def _path(template: str, run: str | RunPublic | dict[str, Any]) -> str:
        """``template`` (of :mod:`qkwatch.contract.api`) with the run filled in: ``project/name`` travels
        with its slash encoded (``%2F``)."""
        return api.path(template, run_ref(run))

    def _id(self, run: str | RunPublic | dict[str, Any]) -> str:
        """The run's id; ``project/name`` is looked up (the ingest and lambda routes take ids only)."""
        ref = run_ref(run)
        return self.run(ref).id if "/" in ref else ref

    def create_run(
        self,
        project: str,
        name: str,
        config: dict[str, Any] | None = None,
        attempt_key: str | None = None,
        *,
        tags: Iterable[str] = (),
        notes: str | None = None,
    ) -> RunPublic:
        """Create or resume a run; the answer's ``attempt`` is the attempt to report under.

        ``tags`` are added to the run's (a resume never removes one); ``notes`` are stored when the
        run has none (change them with :meth:`update_run`).
        """
        body: dict[str, Any] = {"project": project, "name": name, "config": config or {}, "attempt_key": attempt_key}
        if tags:
            body["tags"] = _tags(tags)
        if notes is not None:
            body["notes"] = notes
        return RunPublic.of(self._json("POST", api.RUNS, json=body))

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
    ) -> RunsPublic:
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
        return RunsPublic.of(self._json("GET", api.RUNS, params=params))

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
    ) -> list[RunPublic]:
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
        out: list[RunPublic] = []
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

    def run(self, run: str | RunPublic | dict[str, Any]) -> RunPublic:
        return RunPublic.of(self._json("GET", self._path(api.RUN, run)))

    def set_status(
        self, run: str | RunPublic | dict[str, Any], status: str, reason: str | None = None, attempt: int | None = None
    ) -> RunPublic:
        """Say how the run ended ("finished", "crashed"); ``reason`` is stored as ``status_reason``."""
        body = {"status": status, "reason": reason, "attempt": attempt}
        return RunPublic.of(
            self._json("PATCH", self._path(api.RUN, run), json={k: v for k, v in body.items() if v is not None})
        )

    def update_run(
        self,
        run: str | RunPublic | dict[str, Any],
        *,
        tags: Iterable[str] | None = None,
        add_tags: Iterable[str] | None = None,
        remove_tags: Iterable[str] | None = None,
        notes: str | None = None,
    ) -> RunPublic:
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
        return RunPublic.of(self._json("PATCH", self._path(api.RUN, run), json=body))

    def tag(self, run: str | RunPublic | dict[str, Any], *tags: str) -> RunPublic:
        """Add ``tags`` to the run (those it has are kept)."""
        return self.update_run(run, add_tags=tags)

    def untag(self, run: str | RunPublic | dict[str, Any], *tags: str) -> RunPublic:
        """Remove ``tags`` from the run (one it lacks is fine)."""
        return self.update_run(run, remove_tags=tags)

    def delete_run(self, run: str | RunPublic | dict[str, Any]) -> None:
        self._request("DELETE", self._path(api.RUN, run))

    def events(
        self,
        run: str | RunPublic | dict[str, Any],
        kind: str | None = None,
        attempt: int | None = None,
        limit: int | None = None,
    ) -> EventsPublic:
        return EventsPublic.of(
            self._json("GET", self._path(api.EVENTS, run), params={"kind": kind, "attempt": attempt, "limit": limit})
        )

    def metrics(self, run: str | RunPublic | dict[str, Any]) -> MetricsListPublic:
        """The metrics the run reported, each with its layers."""
        return MetricsListPublic.of(self._json("GET", self._path(api.METRICS, run)))
