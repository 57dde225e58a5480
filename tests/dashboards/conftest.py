"""Fixtures of the dashboards' tests: the real Prometheus tools, servers and a collapsing run.

A missing binary skips locally and fails under ``CI=true`` (tests/conftest.py); install them with
``apt-get install prometheus prometheus-alertmanager`` (``.ci/run`` does).

``start_prometheus(targets, rule_files=(), alertmanagers=(), interval="1s") -> str``
    Starts a real Prometheus and returns its URL (``http://127.0.0.1:<free port>``). It scrapes
    ``targets`` (collector URLs such as ``collapsing_run.collector_url``, or ``host:port``) as job
    "qkwatch" with the committed qkwatch/dashboards/prometheus/prometheus.yml, every ``interval`` (also
    the rule evaluation interval), evaluates ``rule_files`` (paths) and sends alerts to
    ``alertmanagers`` (URLs). Its TSDB and log are under the test's tmp_path; it is stopped at
    the end of the test. Query it with ``promstack.query(url, expr)`` (raises on a PromQL error)
    or ``promstack.wait_for_result(url, expr)`` (waits for the first scrape to land).

``start_alertmanager(config: dict) -> str``
    Starts a real Alertmanager with ``config`` (the parsed YAML), clustering off; returns its URL.

``webhook -> promstack.WebhookReceiver``
    Records what Alertmanager posts: ``.url``, ``.notifications``, ``.wait_for(match)``.

``collapsing_run -> promstack.CollapsingRun``
    A real collector (``qkwatch serve --open``) with one running run of 8 layers (project
    "qkwatch-e2e", run "vanilla") that has sent one healthy report (QKAI 0.29 everywhere). Feed it
    with ``.report(band_qkai)`` (layers 3-5 at that QKAI, the others at 0.29) or
    ``.collapse()`` (the band's QKAI from 0.29 to 0.91 over 5 reports); ``.collector_url``,
    ``.labels`` ({"project", "run"} as on /metrics).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.conftest import missing_service
from tests.dashboards import promstack


def binary(tool: str) -> str:
    """The path of a Prometheus tool, or skip (fail under CI=true) naming the package to install."""
    path = promstack.find_binary(tool)
    if path is None:
        package = "prometheus-alertmanager" if tool in ("alertmanager", "amtool") else "prometheus"
        missing_service(f"{tool} is not installed (apt-get install {package})")
    return path


@pytest.fixture
def promtool() -> str:
    return binary("promtool")


@pytest.fixture
def amtool() -> str:
    return binary("amtool")


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Factory: ``start_prometheus(targets, rule_files=(), alertmanagers=(), interval="1s") -> URL``."""
    path = binary("prometheus")
    started: list[promstack.Server] = []
    numbers = itertools.count()

    def start(
        targets: Sequence[str], rule_files: Sequence[Path] = (), alertmanagers: Sequence[str] = (), interval: str = "1s"
    ) -> str:
        workdir = tmp_path / f"prometheus-{next(numbers)}"
        started.append(promstack.prometheus(path, workdir, targets, rule_files, alertmanagers, interval))
        return started[-1].url

    yield start
    for server in started:
        server.close()


@pytest.fixture
def start_alertmanager(tmp_path: Path) -> Iterator[Callable[[dict], str]]:
    """Factory: ``start_alertmanager(config) -> URL``."""
    path = binary("alertmanager")
    started: list[promstack.Server] = []
    numbers = itertools.count()

    def start(config: dict) -> str:
        started.append(promstack.alertmanager(path, tmp_path / f"alertmanager-{next(numbers)}", config))
        return started[-1].url

    yield start
    for server in started:
        server.close()


@pytest.fixture
def webhook() -> Iterator[promstack.WebhookReceiver]:
    receiver = promstack.WebhookReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def collapsing_run(collector) -> Iterator[promstack.CollapsingRun]:
    """A live collector with run qkwatch-e2e/vanilla (8 layers, band 3-5), one healthy report sent."""
    collector.start()
    with collector.client() as client:
        run = client.create_run("qkwatch-e2e", "vanilla", {"n_layers": 8})
        fed = promstack.CollapsingRun(client, collector.url, run)
        fed.report(0.29)
        yield fed
