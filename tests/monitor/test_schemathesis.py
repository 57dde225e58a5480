"""schemathesis against /openapi.json (bounded examples): no request the schema allows may get a 5xx.

Run on both databases: PostgreSQL refuses values SQLite takes (integers out of range, NUL in
text), and such a value must be a 4xx, never a 500.
"""

from __future__ import annotations

import itertools
import uuid

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from qkwatch.monitor.main import create_app
from tests.monitor.conftest import make_settings

EXAMPLES_PER_OPERATION = 25


def test_no_server_errors(db_url: str):
    app = create_app(make_settings(db_url, open_access=True))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # Half of the cases go to a real run, so ingest and the queries get past the 404.
    seeded = (
        TestClient(app)
        .post("/v1/runs", json={"project": "fuzz", "name": f"fuzz-{uuid.uuid4().hex[:8]}", "config": {"n_layers": 4}})
        .json()["id"]
    )
    calls = itertools.count()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14  # every route is in the schema
    failures = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            if "run_id" in (case.path_parameters or {}) and next(calls) % 2:
                case.path_parameters["run_id"] = seeded
            response = case.call()
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} {case.query} -> {response.status_code}: {response.text[:300]}"
                )

        check()
    assert not failures, "\n".join(failures[:10])
