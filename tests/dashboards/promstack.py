"""Real Prometheus and Alertmanager processes, a webhook receiver, and a run that collapses.

Each server runs on a free loopback port with its own temporary data directory, so tests never
meet a system Prometheus (Debian's package installs one on :9090) or each other. The fixtures
that use these live in tests/dashboards/conftest.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from qkwatch.client.rest import Client
from tests.live import ROOT, free_port

PROMETHEUS_DIR = ROOT / "qkwatch" / "dashboards" / "prometheus"
PROMETHEUS_YML = PROMETHEUS_DIR / "prometheus.yml"
RULES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
ALERTMANAGER_YML = ROOT / "qkwatch" / "dashboards" / "alertmanager" / "alertmanager.yml"

# Debian names the Alertmanager binary prometheus-alertmanager; upstream's tarball, alertmanager.
BINARIES = {
    "prometheus": ("prometheus",),
    "promtool": ("promtool",),
    "alertmanager": ("alertmanager", "prometheus-alertmanager"),
    "amtool": ("amtool",),
}


def find_binary(tool: str) -> str | None:
    """The path of ``tool`` (a key of BINARIES) on PATH, or None."""
    return next(filter(None, map(shutil.which, BINARIES[tool])), None)


def host_port(url: str) -> str:
    """``http://127.0.0.1:8000`` -> ``127.0.0.1:8000`` (what a static_config target is)."""
    return urlsplit(url).netloc if "//" in url else url


class Server:
    """A server binary in a subprocess, logging to a file; ready when GET /-/ready answers 200."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.command, self.log = command, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> Server:
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, timeout, f"{self.command[0]} ready at {self.url}")
        except BaseException:
            self.close()  # nothing else holds it yet: do not leave it running
            raise
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.command[0]} exited:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def prometheus_config(
    targets: Sequence[str], rule_files: Sequence[Path], alertmanagers: Sequence[str], interval: str
) -> dict:
    """The committed prometheus.yml with these targets, rules, Alertmanagers and intervals."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host_port(u) for u in alertmanagers]}]}]}
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [host_port(t) for t in targets]}]
    return config


def prometheus(
    binary: str,
    workdir: Path,
    targets: Sequence[str],
    rule_files: Sequence[Path] = (),
    alertmanagers: Sequence[str] = (),
    interval: str = "1s",
) -> Server:
    """A started Prometheus scraping ``targets`` as job "qkwatch", data and log under ``workdir``."""
    workdir.mkdir(parents=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets, rule_files, alertmanagers, interval)))
    port = free_port()
    return Server(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        port,
        workdir / "prometheus.log",
    ).start()


def alertmanager(binary: str, workdir: Path, config: dict) -> Server:
    """A started Alertmanager with ``config``, clustering off, data and log under ``workdir``."""
    workdir.mkdir(parents=True)
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    return Server(
        [
            binary,
            f"--config.file={path}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        port,
        workdir / "alertmanager.log",
    ).start()


def query(prometheus_url: str, expr: str) -> list[dict]:
    """The result of an instant query (``[{"metric": {...}, "value": [t, "v"]}, ...]``); errors raise."""
    answer = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10).json()
    if answer["status"] != "success":
        raise AssertionError(f"{expr!r}: {answer.get('errorType')}: {answer.get('error')}")
    return answer["data"]["result"]


def wait_for_result(prometheus_url: str, expr: str, timeout: float = 20.0) -> list[dict]:
    """Poll ``expr`` until it returns a non-empty result (e.g. until the first scrape landed)."""
    found: list[dict] = []

    def nonempty() -> bool:
        found[:] = query(prometheus_url, expr)
        return bool(found)

    wait_until(nonempty, timeout, f"a result for {expr!r}")
    return found


def wait_until(condition: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class WebhookReceiver:
    """Records the notifications Alertmanager posts (an http.server on a free loopback port, in a thread)."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver._changed:
                    receiver.notifications.append({"path": self.path, **body})
                    receiver._changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:  # keep pytest's output clean
                pass

        return Handler

    def wait_for(self, match: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        """The first notification for which ``match`` is true, waiting for it to arrive."""
        with self._changed:
            found = self._changed.wait_for(lambda: next(filter(match, self.notifications), None), timeout)
        if found is None:
            raise AssertionError(f"no matching notification within {timeout:g} s; got {self.summary()}")
        return found

    def summary(self) -> list[str]:
        """One line per notification: receiver, status, alert name and layers (for failure messages)."""
        return [
            f"{n['receiver']} {n['status']} {n['groupLabels'].get('alertname')} "
            f"{sorted(a['labels'].get('layer', '-') for a in n['alerts'])}"
            for n in self.notifications
        ]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class CollapsingRun:
    """A run fed report by report through the collector's HTTP API, whose ``band`` layers collapse.

    Every report carries all that /metrics exports of a run: qkai, stable_rank, attn_entropy,
    logit_max and lambda per layer, the loss, and the agent's gauges and counters (all quiet), with
    the stable rank falling and the entropy and largest logit rising as a layer's QKAI rises, as in
    the demo.
    """

    client: Client
    collector_url: str
    run: dict
    n_layers: int = 8
    band: tuple[int, ...] = (3, 4, 5)
    every: int = 25
    step: int = 0

    @property
    def labels(self) -> dict[str, str]:
        """The run's labels on /metrics."""
        return {"project": self.run["project"], "run": self.run["name"]}

    def report(self, band_qkai: float | Sequence[float], other_qkai: float = 0.29) -> None:
        """Send the next report: ``band_qkai`` on the band's layers (one value, or one per layer)."""
        values = [band_qkai] * len(self.band) if isinstance(band_qkai, (int, float)) else list(band_qkai)
        qkai = [other_qkai] * self.n_layers
        for layer, value in zip(self.band, values, strict=True):
            qkai[layer] = value
        self.step += self.every
        self.client.send_reports(self.run["id"], [self._report(qkai)])

    def collapse(self, start: float = 0.29, end: float = 0.91, reports: int = 5) -> None:
        """Ramp the band's QKAI from ``start`` to ``end`` over ``reports`` reports (the demo's 0.29 -> 0.91)."""
        for i in range(reports):
            self.report(start + (end - start) * i / max(1, reports - 1))

    def _report(self, qkai: Iterable[float]) -> dict:
        qkai = list(qkai)
        sent = self.step // self.every
        return {
            "step": self.step,
            "time": time.time(),
            "layers": {
                "qkai": qkai,
                "stable_rank": [round(2.2 - 1.0 * max(0.0, q - 0.29), 4) for q in qkai],
                "attn_entropy": [round(min(1.0, 0.57 + 0.7 * max(0.0, q - 0.29)), 4) for q in qkai],
                "lambda": [0.0] * len(qkai),
                "logit_max": [round(6.0 + 10.0 * max(0.0, q - 0.29), 4) for q in qkai],
            },
            "scalars": {
                "loss": round(2.5 - 0.0005 * self.step, 4),
                "agent_queue_depth": 0.0,
                "agent_spool_bytes": 0.0,
                "agent_step_overhead_seconds": 0.002,
                "agent_sent_total": float(sent),
                "agent_retried_total": 0.0,
                "agent_dropped_total": 0.0,
                "agent_dead_lettered_total": 0.0,
            },
        }
