"""docker-compose.yml, as a real Compose implementation reads it, agrees with the files it mounts.

No container engine runs here, so the stack is never started: Debian's ``docker-compose`` (1.29,
``apt-get install docker-compose``) validates and normalises the file with ``config``, which needs
no engine, and the test then follows every path and address: each bind-mounted host path exists,
Prometheus's scrape and Alertmanager targets are the compose services and ports, Grafana's
provisioned data sources point at the compose services and the database the collector uses, and
the dashboards provider reads where the dashboards are mounted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from qkwatch.dashboards.push import GRAFANA_ROLE
from tests.conftest import missing_service

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"postgres", "collector", "prometheus", "alertmanager", "grafana", "demo-vanilla", "demo-raa"}
PORTS = {"collector": 8000, "prometheus": 9090, "alertmanager": 9093, "grafana": 3000}


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``docker-compose config`` of the committed file: validated, interpolated with the defaults, normalised."""
    binary = shutil.which("docker-compose")
    if binary is None:
        missing_service("docker-compose is not installed (apt-get install docker-compose)")
    # No QKWATCH_TOKEN, passwords or .env of the developer's: the file's own defaults.
    empty = tmp_path_factory.mktemp("compose") / "empty.env"
    empty.write_text("")
    result = subprocess.run(
        [
            binary,
            "--project-directory",
            str(ROOT),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "--env-file",
            str(empty),
            "config",
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def binds(service: dict) -> dict[str, Path]:
    """Container path -> host path of each bind mount (named volumes left out)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def host_path(service: dict, container_path: str) -> Path:
    """Where a path inside the container comes from on the host, through the service's bind mounts."""
    for target, source in sorted(binds(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == target or container_path.startswith(target + "/"):
            return source / container_path[len(target) :].lstrip("/")
    raise AssertionError(f"{container_path} is not bind-mounted")


def flag(command: list[str], name: str) -> str:
    (value,) = [c.split("=", 1)[1] for c in command if c.startswith(f"{name}=")]
    return value


def test_services_profiles_and_ports(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    assert {n for n, s in services.items() if s.get("profiles")} == {"demo-vanilla", "demo-raa"}
    for name, port in PORTS.items():
        assert services[name]["ports"] == [f"127.0.0.1:{port}:{port}/tcp"], name
    assert "ports" not in services["postgres"]
    assert "postgres-data" in compose["volumes"]
    assert "postgres-data:/var/lib/postgresql/data:rw" in services["postgres"]["volumes"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["collector"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_every_bind_mount_exists_in_the_repository(compose):
    for name, service in compose["services"].items():
        for target, source in binds(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
            assert ROOT in source.parents, f"{name}: {source} is outside the repository"


def test_collector_is_built_migrated_and_served_on_postgres(compose):
    collector, postgres = compose["services"]["collector"], compose["services"]["postgres"]
    assert collector["build"]["target"] == "collector"
    script = " ".join(collector["command"])
    assert re.search(r"qkwatch db upgrade && exec qkwatch serve --host 0\.0\.0\.0 --port 8000\b", script)
    url = make_url(collector["environment"]["QKWATCH_DATABASE_URL"])
    env = postgres["environment"]
    assert (url.host, url.port, url.database, url.username, url.password) == (
        "postgres",
        5432,
        env["POSTGRES_DB"],
        env["POSTGRES_USER"],
        env["POSTGRES_PASSWORD"],
    )
    targets = re.findall(r"^FROM \S+ AS (\w+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert targets == ["collector", "trainer"]


def test_prometheus_scrapes_the_collector_and_alerts_alertmanager(compose):
    prometheus = compose["services"]["prometheus"]
    config_path = host_path(prometheus, flag(prometheus["command"], "--config.file"))
    config = yaml.safe_load(config_path.read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"collector:{PORTS['collector']}"], f"{config_path}: scrape targets {targets}"
    managers = [t for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"] for t in sc["targets"]]
    assert managers == [f"alertmanager:{PORTS['alertmanager']}"], f"{config_path}: Alertmanagers {managers}"
    for pattern in config["rule_files"]:
        assert list(config_path.parent.glob(pattern)), f"{config_path}: no rule file matches {pattern}"
    alertmanager = compose["services"]["alertmanager"]
    assert host_path(alertmanager, flag(alertmanager["command"], "--config.file")).is_file()


def test_grafana_provisioning_points_at_the_compose_services(compose):
    grafana, postgres = compose["services"]["grafana"], compose["services"]["postgres"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning/datasources")
    sources = {d["type"]: d for f in provisioning.glob("*.yml") for d in yaml.safe_load(f.read_text())["datasources"]}
    pg = sources["grafana-postgresql-datasource"]
    assert pg["url"] == "postgres:5432" and pg["jsonData"]["database"] == postgres["environment"]["POSTGRES_DB"]
    assert pg["user"] == GRAFANA_ROLE
    password = pg["secureJsonData"]["password"].lstrip("$").strip("{}")
    assert grafana["environment"][password] == postgres["environment"][password]
    init = host_path(postgres, "/docker-entrypoint-initdb.d")
    assert any(f"CREATE ROLE {GRAFANA_ROLE} LOGIN" in f.read_text() for f in init.glob("*.sh"))
    prom = urlsplit(sources["prometheus"]["url"])
    assert (prom.hostname, prom.port) == ("prometheus", PORTS["prometheus"])

    providers = host_path(grafana, "/etc/grafana/provisioning/dashboards")
    (provider,) = [p for f in providers.glob("*.yml") for p in yaml.safe_load(f.read_text())["providers"]]
    dashboards = host_path(grafana, provider["options"]["path"])
    assert dashboards == ROOT / "qkwatch" / "dashboards" / "grafana" / "dashboards"
    assert sorted(p.name for p in dashboards.glob("*.json")) == ["run.json", "runs.json"]
    assert host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).is_file()


def test_demo_runs_report_to_the_collector(compose):
    commands = {}
    for name in ("demo-vanilla", "demo-raa"):
        demo = compose["services"][name]
        assert demo["build"]["target"] == "trainer"
        assert demo["environment"]["QKWATCH_URL"] == f"http://collector:{PORTS['collector']}"
        assert demo["depends_on"]["collector"]["condition"] == "service_healthy"
        commands[name] = " ".join(demo["command"])
        assert "qkwatch train --recipe collapse_cpu" in commands[name]
    assert "--set raa.enabled=true" in commands["demo-raa"] and "--set" not in commands["demo-vanilla"]
