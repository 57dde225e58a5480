"""A read of the store sees one state of the database, even when a batch commits half-way through it.

Found by the fleet bench (bench/fleet.py): two replicas answered ``GET .../lambdas`` with the same
``version`` and different lambdas. On PostgreSQL at READ COMMITTED every statement takes a new
snapshot, so ``Store.lambda_state``, which reads the run row (its lambda version) and then the
running entropies, paired a version with the entropies of the next one whenever a batch committed
between its two statements. The tests commit a batch from another store (another connection, as
another replica would) exactly there, deterministically, and on both databases.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from qkwatch.contract.wire import ReportBatch, RunCreate
from qkwatch.monitor.store.engine import make_engine
from qkwatch.monitor.store.store import Store
from qkwatch.rules.ruleset import RuleSet


@pytest.fixture
def stores(db_url: str) -> Iterator[tuple[Store, Store]]:
    """Two stores on one database: the reader, and a writer as another replica's would be."""
    reader, writer = Store(make_engine(db_url)), Store(make_engine(db_url))
    try:
        yield reader, writer
    finally:
        reader.close()
        writer.close()


def entropy_batch(step: int, value: float) -> ReportBatch:
    return ReportBatch.model_validate(
        {
            "batch_id": str(uuid.uuid4()),
            "reports": [{"step": step, "time": float(step), "layers": {"attn_entropy": [value, value]}}],
        }
    )


def commit_before(store: Store, table: str, write: Any) -> list[str]:
    """Run ``write()`` once, just before the store's next statement that reads ``table``; returns
    a list that holds that statement once it ran."""
    done: list[str] = []

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def interleave(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        if not done and f"FROM {table}" in statement:
            done.append(statement)
            write()

    return done


def test_the_lambda_version_and_the_entropies_come_from_one_commit(stores: tuple[Store, Store]) -> None:
    reader, writer = stores
    run, _ = writer.create_or_resume_run(
        RunCreate.model_validate({"project": f"snap-{uuid.uuid4().hex[:8]}", "name": "r", "config": {"n_layers": 2}})
    )
    writer.add_reports(run.id, entropy_batch(0, 0.70), RuleSet.default())
    _, first = reader.lambda_state(run.id)

    # Another replica stores the next report between the read of the run row and that of the entropies.
    step_1 = entropy_batch(1, 0.95)
    done = commit_before(reader, "lambda_state", lambda: writer.add_reports(run.id, step_1, RuleSet.default()))
    _, read = reader.lambda_state(run.id)
    _, later = reader.lambda_state(run.id)

    assert done, "the batch was committed during the read"
    assert later.version == first.version + 1 and later.h != first.h  # and it moved the lambdas
    # What was read is one of the two states that existed, never one version with the other's entropies.
    assert (read.version, read.step, read.h) in [
        (first.version, first.step, first.h),
        (later.version, later.step, later.h),
    ]
