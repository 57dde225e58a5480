"""What a URL qkwatch is given must be: ``http://`` or ``https://``, a host, a port from 1 to 65535.

Held by the collector's settings (``QKWATCH_EXTERNAL_URL``, ``QKWATCH_WEBHOOK_URLS``), the rules
file's webhook receivers and the command line's ``--url``.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def check_http_url(url: object) -> str:
    """``url`` when it is an ``http://`` or ``https://`` URL with a host (and a port, if any, from 1 to 65535);
    ValueError saying what is wrong with it otherwise. Webhook receivers (the rules file,
    ``QKWATCH_WEBHOOK_URLS``), ``QKWATCH_EXTERNAL_URL`` and the CLI's ``--url`` are held to it."""
    if not isinstance(url, str):
        raise ValueError(f"a URL is a string, got {brief(url)}")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"{brief(url)} holds a space or a control character")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed [ of an IPv6 address
        raise ValueError(f"{brief(url)} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{brief(url)} is not an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError(f"{brief(url)} has no host")
    try:
        port = parts.port
    except ValueError:  # not a number, or above 65535
        port = 0
    if port == 0:
        raise ValueError(f"{brief(url)} has a port that is not a number from 1 to 65535")
    return url


def brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
