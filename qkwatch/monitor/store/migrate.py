"""Apply the Alembic migrations shipped inside the package (``qkwatch/monitor/store/migrations``)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from qkwatch.monitor.store.engine import is_postgres

logger = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
# Any constant will do: replicas starting together on one PostgreSQL take turns migrating.
_ADVISORY_LOCK = 0x716B7761


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database to ``revision``; safe to run from several processes at once on PostgreSQL."""
    cfg = alembic_config()
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # one line per plugin otherwise
    with engine.connect().execution_options(write=True) as conn:
        if is_postgres(conn):
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({_ADVISORY_LOCK})")
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if is_postgres(conn):
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({_ADVISORY_LOCK})")
                conn.commit()
    logger.info("database at %s is at revision %s", engine.url.render_as_string(hide_password=True), revision)


@functools.cache
def head_revision() -> str:
    """The newest revision of the shipped migrations: what a database this code runs on must be at."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None  # None only for a script directory without revisions; ours ships them
    return head
