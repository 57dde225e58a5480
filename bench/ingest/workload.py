"""The ingest benchmarks' workload: the reports of one run (``METRICS`` of every layer a step, values that
are functions of (step, layer, metric)), their JSON bodies and their POST, and a fresh database of each kind.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("qkai", "qkai_max", "stable_rank", "attn_entropy", "attn_top1", "pr_gap")


@contextlib.contextmanager
def database(kind: str, tmp: Path, pg_url: str, label: str, driver: str) -> Iterator[str]:
    """A fresh database URL of ``kind``; ``driver`` is the SQLAlchemy driver the server uses."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / f'{label}.db'}"
        return
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    name = f"bench_{label}_{secrets.token_hex(3)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(pg_url).set(database=name, drivername=driver).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def value(step: int, layer: int, m: int) -> float:
    return round(0.3 + 0.4 * math.sin(step / 97 + layer + m), 6)


def reports(steps: range, layers: int) -> list[dict]:
    return [
        {
            "step": s,
            "time": 1.7e9 + s,
            "layers": {name: [value(s, la, m) for la in range(layers)] for m, name in enumerate(METRICS)},
        }
        for s in steps
    ]


def report_bodies(steps: int, layers: int, batch_reports: int) -> list[str]:
    """The run's report batches as JSON bodies, encoded before any clock starts."""
    return [
        json.dumps({"batch_id": str(uuid.uuid4()), "reports": reports(range(s, min(s + batch_reports, steps)), layers)})
        for s in range(0, steps, batch_reports)
    ]


def post_reports(c: httpx.Client, run_id: str, bodies: list[str]) -> int:
    """POST each body in turn; the points the collector says it inserted."""
    inserted = 0
    for body in bodies:
        r = c.post(f"/v1/runs/{run_id}/reports", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        inserted += r.json()["inserted"]
    return inserted
