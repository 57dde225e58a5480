"""One webhook POST, made safe to point at anything: where it may go, how long and how much it may
take, and a signature the receiver can check.

* **Private targets.** A webhook URL is the operator's, but it is also a way to make the collector
  send requests inside its network (to a metadata service, a database's HTTP port, an admin page).
  Unless the operator allows it (``QKWATCH_WEBHOOK_ALLOW_PRIVATE``), a target whose host resolves to a
  loopback, private, link-local (169.254.169.254, the clouds' metadata service), shared, reserved,
  multicast or unspecified address is refused, each time it is sent to (so a name that later resolves
  elsewhere is checked again). Redirects are not followed: a 3xx is a failed delivery.
* **Bounded.** One POST has ``timeout_s`` in all, connecting and reading included; a receiver that
  answers slowly, endlessly or with a huge body is cut off after that time or ``max_response_bytes``,
  and the delivery counts as failed. Deliveries run in the maintenance thread, never on a request.
* **Signed.** With a secret (``QKWATCH_WEBHOOK_SECRET``) each POST carries ``X-Qkwatch-Timestamp``
  (Unix seconds) and ``X-Qkwatch-Signature: sha256=<hex>``, the HMAC-SHA256 of
  ``<timestamp>.<body>`` under the secret; a receiver recomputes it over the raw body and refuses a
  mismatch or a stale timestamp (:func:`verify`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

SIGNATURE = "X-Qkwatch-Signature"
TIMESTAMP = "X-Qkwatch-Timestamp"


@dataclass(frozen=True)
class Policy:
    """How webhooks are sent (``Settings``' webhook fields)."""

    timeout_s: float = 5.0
    allow_private: bool = False
    max_response_bytes: int = 64 * 1024
    secret: str | None = None


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """``sha256=<hex>``: HMAC-SHA256 of ``<timestamp>.<body>`` under ``secret``."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: str, timestamp: str, signature: str, body: bytes, now: float, tolerance_s: float = 300) -> bool:
    """What a receiver does: the signature matches and the timestamp is within ``tolerance_s`` of ``now``."""
    try:
        when = int(timestamp)
    except ValueError:
        return False
    return abs(now - when) <= tolerance_s and hmac.compare_digest(sign(secret, when, body), signature)


def refused(url: str) -> str | None:
    """Why ``url``'s host is not a public address (None when every address it resolves to is public)."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host}: {exc.strerror or exc}"
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])  # an IPv6 scope (%eth0) dropped
        if not address.is_global or address.is_multicast:
            return (
                f"{host} resolves to {address}, a non-public address "
                "(QKWATCH_WEBHOOK_ALLOW_PRIVATE=true lets webhooks reach it)"
            )
    return None


def post(client: httpx.Client, url: str, body: bytes, policy: Policy) -> str | None:
    """POST ``body`` (JSON) to ``url`` under ``policy``; None when delivered, else why not (one line)."""
    if not policy.allow_private:
        why = refused(url)
        if why:
            return f"{url}: refused: {why}"
    headers = {"Content-Type": "application/json"}
    if policy.secret:
        now = int(time.time())
        headers |= {TIMESTAMP: str(now), SIGNATURE: sign(policy.secret, now, body)}
    deadline = time.monotonic() + policy.timeout_s
    try:
        with client.stream("POST", url, content=body, headers=headers) as response:
            read = 0
            for chunk in response.iter_raw():
                read += len(chunk)
                if read > policy.max_response_bytes:
                    return f"{url}: answer longer than {policy.max_response_bytes} bytes, cut off"
                if time.monotonic() > deadline:
                    return f"{url}: no whole answer within {policy.timeout_s:g} s, cut off"
            if response.status_code >= 300:
                moved = " (redirects are not followed)" if 300 <= response.status_code < 400 else ""
                return f"{url}: HTTP {response.status_code}{moved}"
    except httpx.HTTPError as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    return None
