"""The agent's only HTTP code: four calls to the collector behind a small protocol.

:class:`HttpTransport` makes them; :class:`OfflineTransport` stands in when no collector URL is
configured. Every failure becomes a :class:`TransportError` that says whether retrying can help: connection
errors, timeouts, 408, 429 and 5xx can; any other 4xx cannot (the request itself is wrong).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

RETRYABLE_STATUS = {408, 429}


class TransportError(Exception):
    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        body: str = "",
    ):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.body = body


class Transport(Protocol):
    def create_run(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def post_reports(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def get_lambdas(self, run_id: str) -> dict[str, Any]: ...

    def set_status(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class HttpTransport:
    """httpx over one keep-alive connection pool; one instance per thread that uses it."""

    def __init__(self, url: str, token: str | None, timeout: float):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout, connect=min(3.0, timeout))
        )

    def create_run(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/runs", json=body)

    def post_reports(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/reports", json=body)

    def get_lambdas(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/runs/{run_id}/lambdas")

    def set_status(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``PATCH /v1/runs/{id}``: how the run (attempt) ended; idempotent, so safe to retry."""
        return self._call("PATCH", f"/v1/runs/{run_id}", json=body)

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:  # connect, read, write, pool timeouts, protocol errors
            raise TransportError(f"{method} {path}: {type(exc).__name__}: {exc}", retryable=True) from None
        if response.is_success:
            try:
                answer: dict[str, Any] = response.json()  # every collector answer is a JSON object
            except ValueError:
                raise TransportError(f"{method} {path}: the answer is not JSON", retryable=True) from None
            return answer
        status = response.status_code
        retryable = status in RETRYABLE_STATUS or status >= 500
        raise TransportError(
            f"{method} {path}: HTTP {status}: {response.text[:500]}",
            retryable=retryable,
            status=status,
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
            body=response.text,
        )


class OfflineTransport:
    """The transport of an agent without a collector URL: every call fails retryably."""

    def _down(self, *args: Any) -> dict[str, Any]:
        raise TransportError("no collector URL configured (QKWATCH_URL)", retryable=True)

    create_run = post_reports = get_lambdas = set_status = _down

    def close(self) -> None:
        pass


def transports(url: str | None, token: str | None, timeout: float) -> Callable[[], Transport]:
    """A factory of transports to ``url`` (one per thread that uses it); offline ones without a URL."""
    if not url:
        return OfflineTransport
    return lambda: HttpTransport(url, token, timeout)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
