"""Alembic environment: runs the migrations on the connection that ``monitor.store.migrate`` passes in.

Also works from the ``alembic`` command line (``sqlalchemy.url`` in an alembic.ini) for
development, e.g. to autogenerate a new revision against ``monitor.store.models.metadata``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from qkwatch.monitor.store.models import metadata


def run_migrations() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is None:
        from qkwatch.monitor.store.engine import make_engine

        url = config.get_main_option("sqlalchemy.url")
        if url is None:
            raise RuntimeError("no database to migrate: set sqlalchemy.url in alembic.ini")
        engine = make_engine(url)
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
        return
    _run(connection)


def _run(connection: sa.Connection) -> None:
    # render_as_batch: SQLite can only ALTER a table by copying it, which batch mode does.
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


# Alembic installs ``context.config`` only while it runs this file; a plain import (the layering
# test imports every module) must do nothing.
if hasattr(context, "config"):
    run_migrations()
