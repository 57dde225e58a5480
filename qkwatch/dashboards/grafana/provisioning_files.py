"""Grafana's provisioning files for docker-compose.yml: qkwatch's data sources and its dashboard provider."""

from __future__ import annotations

from typing import Any

from qkwatch.dashboards.push import FOLDER_TITLE, FOLDER_UID, DataSources, datasources

GRAFANA_DASHBOARDS = "/var/lib/grafana/dashboards/qkwatch"
"""Where docker-compose.yml mounts qkwatch/dashboards/grafana/dashboards inside the Grafana container."""


def provisioning() -> dict[str, dict[str, Any]]:
    """Grafana's provisioning files for docker-compose.yml (service names postgres and prometheus)."""
    sources = datasources(DataSources(password="$QKWATCH_GRAFANA_DB_PASSWORD"))
    for ds in sources:
        ds["editable"] = False
    sources[1]["isDefault"] = True
    providers = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "qkwatch",
                "orgId": 1,
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 30,
                "options": {"path": GRAFANA_DASHBOARDS, "foldersFromFilesStructure": False},
            }
        ],
    }
    return {
        "provisioning/datasources/qkwatch.yml": {"apiVersion": 1, "datasources": sources},
        "provisioning/dashboards/qkwatch.yml": providers,
    }
