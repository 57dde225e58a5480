"""Grafana: the qkwatch data sources, and ``qkwatch dashboards push`` through Grafana's HTTP API.

The dashboards are the committed JSON files of ``qkwatch/dashboards/grafana/dashboards`` (what Grafana
provisions from disk too). A push creates the folder "qkwatch" when absent, then writes each data
source and dashboard only when Grafana's copy differs from ours (dashboards by uid, overwriting;
data sources by uid), so a second push writes nothing and reports every object "unchanged".

``grafana-client`` (``pip install 'qkwatch[grafana]'``) is imported only by the push itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grafana_client import GrafanaApi  # the grafana extra; imported at run time only by the push

logger = logging.getLogger(__name__)

FOLDER_UID = "qkwatch"
FOLDER_TITLE = "qkwatch"
POSTGRES_UID = "qkwatch-postgres"
PROMETHEUS_UID = "qkwatch-prometheus"
POSTGRES_TYPE = "grafana-postgresql-datasource"
GRAFANA_ROLE = "qkwatch_grafana"
"""The read-only role that migration 0004 creates on PostgreSQL (SELECT on the qkwatch_*_v views only)."""
DASHBOARDS_DIR = Path(__file__).resolve().parents[1] / "dashboards" / "grafana" / "dashboards"
"""The dashboards shipped inside the package (package data); ``QKWATCH_DASHBOARDS_DIR`` or ``--dir`` for others."""


@dataclass(frozen=True)
class DataSources:
    """Where Grafana finds the collector's database and Prometheus (defaults: the compose stack)."""

    postgres: str = "postgres:5432"
    """host:port of PostgreSQL as Grafana's server sees it."""
    database: str = "qkwatch"
    user: str = GRAFANA_ROLE
    password: str | None = None
    """The role's password; None leaves the one Grafana has (or none, for a new data source)."""
    prometheus_url: str = "http://prometheus:9090"
    scrape_interval: str = "15s"
    """Prometheus's scrape interval: Grafana's smallest step, and the basis of ``$__rate_interval``."""


def datasources(cfg: DataSources) -> list[dict[str, Any]]:
    """The two data sources in Grafana's data source model (the HTTP API and provisioning files share it)."""
    postgres: dict[str, Any] = {
        "uid": POSTGRES_UID,
        "name": "qkwatch PostgreSQL",
        "type": POSTGRES_TYPE,
        "access": "proxy",
        "url": cfg.postgres,
        "user": cfg.user,
        "jsonData": {"database": cfg.database, "sslmode": "disable", "postgresVersion": 1500, "timescaledb": False},
    }
    if cfg.password is not None:
        postgres["secureJsonData"] = {"password": cfg.password}
    prometheus = {
        "uid": PROMETHEUS_UID,
        "name": "qkwatch Prometheus",
        "type": "prometheus",
        "access": "proxy",
        "url": cfg.prometheus_url,
        "jsonData": {"httpMethod": "POST", "timeInterval": cfg.scrape_interval},
    }
    return [postgres, prometheus]


def load_dashboards(directory: Path) -> list[dict[str, Any]]:
    """Every ``*.json`` dashboard of ``directory``, by file name."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no dashboards (*.json) in {directory}")
    return [json.loads(f.read_text()) for f in files]


# --- push ------------------------------------------------------------------------------------


def push(
    api: GrafanaApi, dashboards: Iterable[dict[str, Any]], sources: Iterable[dict[str, Any]] = (), force: bool = False
) -> list[tuple[str, str]]:
    """Write what differs; returns (object, "created" | "updated" | "unchanged") in the order pushed.

    Args:
        api: a ``grafana_client.GrafanaApi``.
        dashboards: dashboard models, each with its ``uid``.
        sources: data source models (see :func:`datasources`).
        force: write every object even when Grafana's copy is the same (e.g. to set a new password).
    """
    done = [(f"folder {FOLDER_TITLE}", _push_folder(api))]
    done += [(f"data source {ds['name']}", _push_datasource(api, ds, force)) for ds in sources]
    done += [(f"dashboard {d['title']}", _push_dashboard(api, d, force)) for d in dashboards]
    return done


def _get(call: Callable[..., dict[str, Any]], *args: str) -> dict[str, Any] | None:
    """A GET that answers None for 404."""
    from grafana_client.client import GrafanaClientError

    try:
        return call(*args)
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return None
        raise


def _push_folder(api: GrafanaApi) -> str:
    current = _get(api.folder.get_folder, FOLDER_UID)
    if current is None:
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        return "created"
    if current.get("title") != FOLDER_TITLE:
        api.folder.update_folder(FOLDER_UID, title=FOLDER_TITLE, overwrite=True)
        return "updated"
    return "unchanged"


def _comparable(dashboard: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dashboard.items() if k not in ("id", "version")}


def _push_dashboard(api: GrafanaApi, dashboard: dict[str, Any], force: bool) -> str:
    current = _get(api.dashboard.get_dashboard, dashboard["uid"])
    if (
        not force
        and current is not None
        and current.get("meta", {}).get("folderUid") == FOLDER_UID
        and _comparable(current["dashboard"]) == _comparable(dashboard)
    ):
        return "unchanged"
    api.dashboard.update_dashboard(
        {
            "dashboard": {**_comparable(dashboard), "id": None},
            "folderUid": FOLDER_UID,
            "overwrite": True,
            "message": "qkwatch dashboards push",
        }
    )
    return "created" if current is None else "updated"


def _same_datasource(current: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Grafana's copy has every field we set (it adds its own: id, version, ...); a password counts as set."""
    for key, value in wanted.items():
        if key == "secureJsonData":
            if not all(current.get("secureJsonFields", {}).get(k) for k in value):
                return False
        elif key == "jsonData":
            if any(current.get("jsonData", {}).get(k) != v for k, v in value.items()):
                return False
        elif current.get(key) != value:
            return False
    return True


def _push_datasource(api: GrafanaApi, source: dict[str, Any], force: bool) -> str:
    current = _get(api.datasource.get_datasource_by_uid, source["uid"])
    if current is None:
        api.datasource.create_datasource(source)
        return "created"
    if not force and _same_datasource(current, source):
        return "unchanged"
    api.datasource.update_datasource_by_uid(source["uid"], {**source, "version": current.get("version")})
    return "updated"


# --- command line ----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``qkwatch dashboards push``."""
    p = sub.add_parser("dashboards", help="Grafana dashboards and data sources")
    dsub = p.add_subparsers(dest="dashboards_command", metavar="ACTION", required=True)
    push_p = dsub.add_parser("push", help="upload the dashboards (folder qkwatch) and data sources to a Grafana")
    push_p.add_argument(
        "--grafana-url",
        default=os.environ.get("GRAFANA_URL"),
        help="e.g. http://127.0.0.1:3000 (default: $GRAFANA_URL)",
    )
    push_p.add_argument(
        "--token", default=os.environ.get("GRAFANA_TOKEN"), help="service account token (default: $GRAFANA_TOKEN)"
    )
    push_p.add_argument(
        "--user",
        default=os.environ.get("GRAFANA_USER"),
        help="basic auth instead of a token (default: $GRAFANA_USER; password from $GRAFANA_PASSWORD)",
    )
    push_p.add_argument(
        "--dir",
        type=Path,
        default=Path(os.environ.get("QKWATCH_DASHBOARDS_DIR", DASHBOARDS_DIR)),
        help="dashboard JSON files (default: $QKWATCH_DASHBOARDS_DIR or %(default)s)",
    )
    push_p.add_argument("--no-datasources", action="store_true", help="push the dashboards only")
    push_p.add_argument(
        "--postgres",
        default=DataSources.postgres,
        help="host:port of the collector's PostgreSQL as Grafana sees it (default: %(default)s)",
    )
    push_p.add_argument(
        "--postgres-database",
        default=DataSources.database,
        help="the collector's database name as Grafana sees it (default: %(default)s)",
    )
    push_p.add_argument(
        "--postgres-user",
        default=DataSources.user,
        help="a role with SELECT on the qkwatch_*_v views (default: %(default)s); its password "
        "comes from $QKWATCH_GRAFANA_DB_PASSWORD",
    )
    push_p.add_argument(
        "--prometheus-url",
        default=DataSources.prometheus_url,
        help="Prometheus as Grafana sees it (default: %(default)s)",
    )
    push_p.add_argument("--force", action="store_true", help="write everything, even what is unchanged")
    push_p.set_defaults(handler=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    if not args.grafana_url:
        print("qkwatch dashboards push: --grafana-url (or $GRAFANA_URL) is required", file=sys.stderr)
        return 2
    try:
        from grafana_client import GrafanaApi
        from grafana_client.client import GrafanaException
        from requests.exceptions import RequestException
    except ImportError:
        print("qkwatch dashboards push needs grafana-client: pip install 'qkwatch[grafana]'", file=sys.stderr)
        return 2
    try:
        boards = load_dashboards(args.dir)
    except FileNotFoundError as exc:
        print(f"qkwatch dashboards push: {exc}; pass --dir", file=sys.stderr)
        return 2
    sources = (
        []
        if args.no_datasources
        else datasources(
            DataSources(
                postgres=args.postgres,
                database=args.postgres_database,
                user=args.postgres_user,
                password=os.environ.get("QKWATCH_GRAFANA_DB_PASSWORD"),
                prometheus_url=args.prometheus_url,
            )
        )
    )
    credential = args.token or ((args.user, os.environ.get("GRAFANA_PASSWORD", "")) if args.user else None)
    api = GrafanaApi.from_url(args.grafana_url, credential=credential)
    try:
        done = push(api, boards, sources, force=args.force)
    except (GrafanaException, RequestException) as exc:  # Grafana's answer, or no answer
        print(f"qkwatch dashboards push: {exc}", file=sys.stderr)
        return 1
    for what, outcome in done:
        print(f"{outcome:9} {what}")
    written = sum(outcome != "unchanged" for _, outcome in done)
    print(f"{written} of {len(done)} objects written to {args.grafana_url}")
    return 0
