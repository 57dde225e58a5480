"""The agent's only HTTP code: four calls to the collector behind a small protocol.

:class:`HttpTransport` makes them; :class:`OfflineTransport` stands in when no collector URL is
configured. Every failure becomes a :class:`TransportError` that says whether retrying can help: connection
errors, timeouts, 3xx (a redirect is never followed), 408, 429 and 5xx can; any other 4xx cannot (the
request itself is wrong).

Every answer is treated as hostile: each request has a total deadline (its timeout, from the first
byte sent to the last byte read), an answer body is read up to :data:`MAX_ANSWER_BYTES` and no
further, and the two answers the agent reads (a run, its lambdas) must fit the contract's models
(:mod:`qkwatch.contract.answers`). An answer that breaks any of this is a retryable failure, warned
about once per kind (:class:`FaultLog`). The token never appears in a message.
"""

from __future__ import annotations

import contextlib
import email.utils
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from qkwatch.contract import api
from qkwatch.contract.answers import LambdasAnswer, ReportsAnswer, RunAnswer

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 429}
MAX_ANSWER_BYTES = 1 << 20
"""The most of an answer's body the agent reads; a longer answer is a failure (retried)."""
TOKEN = re.compile(r"[\x21-\x7e]+")
"""What a bearer token may hold: printable ASCII without spaces (what an HTTP header carries as it is)."""
FAULT_REPEAT_SECONDS = 300.0
"""After its first warning, a kind of fault is warned about again at most this often (with a count)."""


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


class FaultLog:
    """Warns the first time a kind of fault happens, then at most every ``repeat`` seconds with a count.

    Shared by an agent's transports (the start-up fetch, the sender, the poller), so a collector
    that answers 500 is said once, not once per thread; thread-safe.
    """

    def __init__(self, repeat: float = FAULT_REPEAT_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.repeat = repeat
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (when last warned, faults since)

    def note(self, kind: str, message: str) -> None:
        now = self.clock()
        with self._lock:
            last, since = self._seen.get(kind, (None, 0))
            if last is not None and now - last < self.repeat:
                self._seen[kind] = (last, since + 1)
                return
            self._seen[kind] = (now, 0)
        more = f" ({since} more since the last warning)" if since else ""
        logger.warning(
            "qkwatch: %s%s; retrying (more of this kind are counted, and said at most every %g s)",
            message,
            more,
            self.repeat,
        )


class HttpTransport:
    """httpx over one keep-alive connection pool; one instance per thread that uses it.

    Args:
        url: the collector's base URL.
        token: the bearer token (checked by ``AgentConfig``: printable ASCII, no spaces).
        timeout: each request's total deadline in seconds (connect: at most 3).
        until: a ``time.monotonic()`` no request may outlast (``attach()``'s start-up budget).
        faults: where faults are warned about (shared by an agent's transports).
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float,
        *,
        until: float | None = None,
        faults: FaultLog | None = None,
    ):
        token = clean_token(token)
        self._secret = token
        headers = {"Accept-Encoding": "identity"}  # a compressed answer could expand past the cap in one read
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.timeout = timeout
        self.until = until
        self.faults = faults if faults is not None else FaultLog()
        self._sock: socket.socket | None = None  # the connection's socket, for the deadline to cut
        self._guard = threading.Lock()
        self._active = self._cut_off = False
        self._client = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout, connect=min(3.0, timeout))
        )

    def create_run(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._checked(RunAnswer, self._call("POST", api.RUNS, json=body), f"POST {api.RUNS}")

    def post_reports(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self._call("POST", api.path(api.REPORTS, run_id, quoted=False), json=body)
        return self._checked(ReportsAnswer, answer, f"POST {api.REPORTS}")

    def get_lambdas(self, run_id: str) -> dict[str, Any]:
        answer = self._call("GET", api.path(api.LAMBDAS, run_id, quoted=False))
        return self._checked(LambdasAnswer, answer, f"GET {api.LAMBDAS}")

    def set_status(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``PATCH /v1/runs/{id}``: how the run (attempt) ended; idempotent, so safe to retry."""
        return self._call("PATCH", api.path(api.RUN, run_id, quoted=False), json=body)

    def close(self) -> None:
        self._client.close()

    # --- one request ----------------------------------------------------------------------------

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One request within its deadline; the answer as a JSON object, or TransportError."""
        what = f"{method} {path}"
        deadline = time.monotonic() + self.timeout
        if self.until is not None:
            deadline = min(deadline, self.until)
        try:
            status, headers, body = self._exchange(method, path, deadline, **kwargs)
        except httpx.ConnectError as exc:  # the collector away: the agent's ordinary offline mode, not warned
            raise TransportError(f"{what}: {type(exc).__name__}: {self._scrub(str(exc))}", retryable=True) from None
        except _Refused as exc:  # past the deadline or the cap
            raise self._fault(what, str(exc), kind=exc.kind) from None
        except httpx.HTTPError as exc:  # timeouts, protocol errors
            kind = type(exc).__name__
            raise self._fault(what, f"{kind}: {self._scrub(str(exc))}", kind=kind) from None
        text = self._scrub(body.decode("utf-8", "replace"))  # an answer may echo the request's headers
        if 200 <= status < 300:
            try:
                answer = json.loads(text)
            except (ValueError, RecursionError):
                message = f"HTTP {status} but the answer is not JSON: {text[:100]!r}"
                raise self._fault(what, message, kind="not JSON") from None
            if not isinstance(answer, dict):  # every collector answer is a JSON object
                raise self._fault(what, f"the answer is a JSON {type(answer).__name__}, not an object", kind="shape")
            return answer
        if 300 <= status < 400:  # never followed, never a refusal: the collector is misplaced for now
            where = headers.get("location", "")[:200]
            raise self._fault(
                what, f"HTTP {status} redirect to {where!r} (not followed)", kind="redirect", status=status
            )
        retryable = status in RETRYABLE_STATUS or status >= 500
        error = TransportError(
            f"{what}: HTTP {status}: {text[:500]}",
            retryable=retryable,
            status=status,
            retry_after=parse_retry_after(headers.get("retry-after")),
            body=text,
        )
        if status >= 500:
            self.faults.note(f"HTTP {status}", f"the collector answered {what} with HTTP {status}: {text[:200]!r}")
        raise error

    def _exchange(self, method: str, path: str, deadline: float, **kwargs: Any) -> tuple[int, httpx.Headers, bytes]:
        """Send, and read the answer up to the cap and the deadline.

        httpx's timeouts bound each read, not the whole: a timer shuts the socket down at the
        deadline, which ends a read of headers trickled a byte at a time.
        """
        left = _left(deadline)
        timer = threading.Timer(left, self._cut)
        timer.daemon = True
        with self._guard:
            self._active, self._cut_off = True, False
        timer.start()
        try:
            return self._read(method, path, deadline, httpx.Timeout(left, connect=min(3.0, left)), **kwargs)
        except httpx.HTTPError:
            if self._cut_off:
                raise _Refused("no complete answer within the request's deadline", "too slow") from None
            raise
        finally:
            with self._guard:
                self._active = False
            timer.cancel()

    def _cut(self) -> None:
        """At the deadline of a request still running: shut its socket down (the read then fails)."""
        with self._guard:
            if not self._active or self._sock is None:
                return
            self._cut_off = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _traced(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace: keeps the socket of each new connection (one at a time: one thread uses it)."""
        if event == "connection.connect_tcp.complete":
            self._sock = info["return_value"].get_extra_info("socket")

    def _read(
        self, method: str, path: str, deadline: float, timeout: httpx.Timeout, **kwargs: Any
    ) -> tuple[int, httpx.Headers, bytes]:
        extensions = {"trace": self._traced}
        with self._client.stream(method, path, timeout=timeout, extensions=extensions, **kwargs) as response:
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise _Refused(f"the answer is {encoding[:40]!r}-encoded (asked for identity)", "encoded")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
                raise _Refused(
                    f"the answer declares {declared[:20]} bytes (at most {MAX_ANSWER_BYTES} are read)", "too large"
                )
            chunks: list[bytes] = []
            size = 0
            for chunk in response.iter_raw():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise _Refused(f"the answer is longer than {MAX_ANSWER_BYTES} bytes (cut off)", "too large")
                chunks.append(chunk)
                _left(deadline)
            return response.status_code, response.headers, b"".join(chunks)

    def _checked(self, model: type[BaseModel], answer: dict[str, Any], what: str) -> dict[str, Any]:
        """``answer`` if it fits ``model`` (as the model reads it), else a warned, retryable failure."""
        try:
            return model.model_validate(answer).model_dump()
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(x) for x in error["loc"]) or "answer"
            raise self._fault(what, f"the answer does not fit ({where}: {error['msg']})", kind="shape") from None

    def _fault(self, what: str, message: str, *, kind: str, status: int | None = None) -> TransportError:
        self.faults.note(f"{what} {kind}", f"the collector's answer to {what}: {message}")
        return TransportError(f"{what}: {message}", retryable=True, status=status)

    def _scrub(self, text: str) -> str:
        return text.replace(self._secret, "[token]") if self._secret else text


class _Refused(Exception):
    """An answer past the deadline or the cap, or encoded; becomes a retryable TransportError."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _left(deadline: float) -> float:
    """Seconds left before ``deadline``; _Refused when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Refused("no complete answer within the request's deadline", "too slow")
    return left


class OfflineTransport:
    """The transport of an agent without a collector URL: every call fails retryably."""

    def _down(self, *args: Any) -> dict[str, Any]:
        raise TransportError("no collector URL configured (QKWATCH_URL)", retryable=True)

    create_run = post_reports = get_lambdas = set_status = _down

    def close(self) -> None:
        pass


def transports(
    url: str | None, token: str | None, timeout: float, faults: FaultLog | None = None
) -> Callable[[], Transport]:
    """A factory of transports to ``url`` (one per thread that uses it); offline ones without a URL.

    They share ``faults`` (a new one if None), and a token bound for a plain ``http://`` URL of a
    host that is not loopback is warned about here, once.
    """
    if not url:
        return OfflineTransport
    if token:
        warn_if_exposed(url)
    shared = faults if faults is not None else FaultLog()
    return lambda: HttpTransport(url, token, timeout, faults=shared)


def clean_token(token: str | None) -> str | None:
    """``token`` without surrounding whitespace (a file's trailing newline); None if nothing is left.

    Raises:
        ValueError: for a token an HTTP header cannot carry; the message does not show it.
    """
    if token is None or not token.strip():
        return None
    token = token.strip()
    if not TOKEN.fullmatch(token):
        raise ValueError(
            f"{len(token)} characters, some of which an HTTP header cannot carry "
            "(a token is printable ASCII without spaces); the token is not shown"
        )
    return token


def warn_if_exposed(url: str) -> bool:
    """Warn that a token will cross the network in clear text (``http://`` to a host not loopback)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http" or _loopback(host):
        return False
    logger.warning(
        "qkwatch: the collector URL http://%s is plain http:// to a host that is not loopback: the token and "
        "every lambda travel unencrypted (anyone on the path can read the token and change the lambdas); "
        "use https://",
        host[:200],
    )
    return True


def _loopback(host: str) -> bool:
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value[:12])
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
