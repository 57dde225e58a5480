"""Headless Chromium for the page tests: one-shot runs (``--dump-dom``, ``--screenshot``) and a page
driven over the DevTools protocol.

Chromium is Debian's ``/usr/bin/chromium`` (installed by ``.ci/run``); without it the browser tests
skip locally and fail under CI=true. Every start is offline: background networking is off and every
host name but the loopback address resolves to nothing, so a page that needs a CDN shows it.

The DevTools protocol runs over a pipe (``--remote-debugging-pipe``: JSON messages ending in a NUL
byte, commands on the browser's fd 3, answers and events on its fd 4), so no websocket client and no
Playwright are needed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import struct
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from tests.conftest import missing_service

CHROMIUM = "/usr/bin/chromium"
BASE_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def need_chromium() -> None:
    if not Path(CHROMIUM).exists():
        missing_service(f"Chromium at {CHROMIUM} (apt-get install chromium)")


def chromium(url: str, profile: Path, *extra: str, budget_ms: int = 8000, timeout: float = 120) -> str:
    """Open ``url`` in headless Chromium for ``budget_ms`` of virtual time; its stdout (the DOM with --dump-dom)."""
    command = [CHROMIUM, *BASE_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *extra, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def keep(path: Path) -> Path:
    """Copy a test artefact (a screenshot) to ``$QKWATCH_ARTIFACTS`` when that is set; the path either way."""
    folder = os.environ.get("QKWATCH_ARTIFACTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, Path(folder) / path.name)
    return path


class Tags(HTMLParser):
    """Every start tag of a document, as (tag, attributes); script bodies are skipped as data."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))


def references(document: str) -> list[str]:
    """The URLs a document's elements load or link: their src, href, srcset, data and poster attributes."""
    parser = Tags()
    parser.feed(document)
    return [v for _, a in parser.tags for k, v in a.items() if k in {"src", "href", "srcset", "data", "poster"}]


def off_site(urls: list[str], site: str = "") -> list[str]:
    """The absolute http(s) URLs among ``urls`` that are not under ``site``."""
    return [
        u for u in urls if u.strip().lower().startswith(("http:", "https:", "//")) and not (site and u.startswith(site))
    ]


def _high(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Page:
    """One tab of a headless Chromium driven over the DevTools protocol; use as a context manager."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 900, timeout: float = 60) -> None:
        self.timeout = timeout
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The browser's ends, moved above 9 so that putting them on fds 3 and 4 cannot overwrite either.
        to_browser_r, from_browser_w = (_high(fd) for fd in (to_browser_r, from_browser_w))
        command = [
            CHROMIUM,
            *BASE_FLAGS,
            "--remote-debugging-pipe",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        # The browser wants the pipe on fds 3 and 4 exactly; bash puts it there (dash takes single-digit fds only).
        shell = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
        self.proc = subprocess.Popen(
            ["/bin/bash", "-c", shell, "bash", *command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._open = True
        self._buffer = b""
        self._next_id = 0
        try:
            target = self._send("Target.createTarget", url="about:blank")["targetId"]
            self.session = self._send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        except BaseException:
            self.close()
            raise

    # ---- protocol ----

    def _send(self, method: str, session: str | None = None, **params: Any) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._read()
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise ConnectionError("Chromium closed the pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, **params: Any) -> dict:
        """A command to the tab."""
        return self._send(method, self.session, **params)

    # ---- what the tests use ----

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30, every: float = 0.2) -> Any:
        """Poll until ``expression`` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.eval(expression)
            except RuntimeError:
                value = None  # the page is still loading
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"not true within {timeout} s: {expression} (last value {value!r})")

    def screenshot(self, path: Path, full_page: bool = False, element: str | None = None, scale: float = 1) -> Path:
        """A PNG of the viewport, the whole page, or the element a CSS selector names (``scale`` times its size)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            width, height = self.eval("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params |= {
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": scale},
            }
        elif element:
            box = self.eval(
                f"(() => {{ const r = document.querySelector({json.dumps(element)}).getBoundingClientRect();"
                " return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}; })()"
            )
            params |= {"captureBeyondViewport": True, "clip": {**box, "scale": scale}}
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))
        return path

    def close(self) -> None:
        """Close the browser (politely, then by force) and the pipe; idempotent."""
        if not self._open:
            return
        self._open = False
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError, ConnectionError):
                self._send("Browser.close")
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
