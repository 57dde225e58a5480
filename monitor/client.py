"""A synchronous Python client of the collector's REST API (httpx only).

Shared by ``qkwatch report``, the CLI and users::

    from monitor.client import Client
    with Client("http://127.0.0.1:8000", token="qkw_...") as c:
        run = c.create_run("proj", "run-1", config={"n_layers": 24})
        c.send_reports(run["id"], [{"step": 0, "time": 0.0, "layers": {"qkai": [0.3] * 24}}])
        c.heatmap(run["id"], "qkai")

Every method returns the decoded JSON (values stay wire values: numbers or "nan"/"inf"/"-inf";
:func:`monitor.wire.decode_value` turns them into floats). Errors raise :class:`CollectorError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from monitor.wire import Report


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


class Client:
    """Client of one collector. Use as a context manager, or call :meth:`close`."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
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

    # runs
    def health(self) -> dict:
        return self._json("GET", "/healthz")

    def create_run(self, project: str, name: str, config: dict | None = None, attempt_key: str | None = None) -> dict:
        """Create or resume a run; the answer's ``attempt`` is the attempt to report under."""
        return self._json("POST", "/v1/runs", json={"project": project, "name": name, "config": config or {},
                                                    "attempt_key": attempt_key})

    def runs(self, project: str | None = None, status: str | None = None, name: str | None = None,
             limit: int = 100, offset: int = 0) -> dict:
        return self._json("GET", "/v1/runs", params={"project": project, "status": status, "name": name,
                                                     "limit": limit, "offset": offset})

    def run(self, run_id: str) -> dict:
        return self._json("GET", f"/v1/runs/{run_id}")

    def set_status(self, run_id: str, status: str, reason: str | None = None, attempt: int | None = None) -> dict:
        """Say how the run ended ("finished", "crashed"); ``reason`` is stored as ``status_reason``."""
        body = {"status": status, "reason": reason, "attempt": attempt}
        return self._json("PATCH", f"/v1/runs/{run_id}", json={k: v for k, v in body.items() if v is not None})

    def delete_run(self, run_id: str) -> None:
        self._request("DELETE", f"/v1/runs/{run_id}")

    def events(self, run_id: str, kind: str | None = None, attempt: int | None = None) -> dict:
        return self._json("GET", f"/v1/runs/{run_id}/events", params={"kind": kind, "attempt": attempt})

    def metrics(self, run_id: str) -> dict:
        return self._json("GET", f"/v1/runs/{run_id}/metrics")["metrics"]

    # ingest
    def send_reports(self, run_id: str, reports: Iterable[Report | dict], batch_id: str | None = None,
                     attempt: int | None = None) -> dict:
        """Send one batch; reuse ``batch_id`` when retrying it, so it is stored once."""
        body = {"batch_id": batch_id or str(uuid.uuid4()), "attempt": attempt,
                "reports": [r.model_dump(mode="json") if isinstance(r, Report) else r for r in reports]}
        return self._json("POST", f"/v1/runs/{run_id}/reports", json=body)

    # queries
    def series(self, run_id: str, metric: str, layer: int = -1, **params: Any) -> dict:
        """params: head, start, end, max_points, attempt."""
        return self._json("GET", f"/v1/runs/{run_id}/series", params={"metric": metric, "layer": layer, **params})

    def heatmap(self, run_id: str, metric: str = "qkai", **params: Any) -> dict:
        """params: start, end, max_steps, agg ("max", "min", "mean"), head, attempt."""
        return self._json("GET", f"/v1/runs/{run_id}/heatmap", params={"metric": metric, **params})

    def compare(self, run_ids: Iterable[str], metric: str, layer: int = -1, **params: Any) -> dict:
        query = [("run", r) for r in run_ids] + [("metric", metric), ("layer", layer), *params.items()]
        return self._json("GET", "/v1/compare", params=query)

    def export(self, run_id: str, format: str = "csv", attempt: int | None = None) -> Iterator[str]:
        """Stream the run's points as lines of CSV (with a header) or JSON."""
        params = {"format": format, **({"attempt": attempt} if attempt else {})}
        with self._http.stream("GET", f"/v1/runs/{run_id}/export", params=params) as response:
            if response.status_code >= 400:
                response.read()
                raise CollectorError(response.status_code, _message(response))
            yield from response.iter_lines()

    # alerts and lambdas
    def alerts(self, run: str | None = None, state: str | None = None) -> dict:
        return self._json("GET", "/v1/alerts", params={"run": run, "state": state})

    def lambdas(self, run_id: str) -> dict:
        return self._json("GET", f"/v1/runs/{run_id}/lambdas")

    def set_overrides(self, run_id: str, overrides: dict[int | str, float | None]) -> dict:
        """Set per-layer overrides (None removes one); needs the control scope."""
        return self._json("PUT", f"/v1/runs/{run_id}/lambdas/overrides",
                          json={str(k): v for k, v in overrides.items()})

    def lambdas_audit(self, run_id: str) -> dict:
        return self._json("GET", f"/v1/runs/{run_id}/lambdas/audit")
