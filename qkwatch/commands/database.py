"""The settings and the database of the commands that run on the collector's host (``serve``, ``token``,
``db``): flags over ``QKWATCH_*`` over defaults, the migrated database, and each problem as a
:class:`StartupError` line that names where the bad value came from and never a password.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import TYPE_CHECKING, Any

from qkwatch.commands.errors import StartupError, first_line

if TYPE_CHECKING:  # for annotations only: the functions import these when they run
    from sqlalchemy.engine import Engine

    from qkwatch.monitor.settings import Settings
    from qkwatch.monitor.store.store import Store


def database_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url", default=None, help="SQLAlchemy URL (default: $QKWATCH_DATABASE_URL or sqlite:///qkwatch.db)"
    )


FLAGS = {"database_url": "--database-url", "alert_rules_file": "--rules", "open_access": "--open"}
"""The flag that sets a setting, for the messages about a value given by it."""


def effective_settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    """The settings, flags over ``QKWATCH_*`` over defaults; StartupError naming the variable (or the flag)
    and the value of the first bad one."""
    from qkwatch.monitor.settings import SettingError, load_settings

    if getattr(args, "database_url", None) is not None:
        overrides["database_url"] = args.database_url
    try:
        return load_settings({k: FLAGS[k] for k in overrides if k in FLAGS}, **overrides)
    except SettingError as exc:
        raise StartupError(f"setting {exc}") from None


def database_source(args: argparse.Namespace) -> str:
    """Where the database URL came from, for messages: the flag, the variable or the default."""
    if getattr(args, "database_url", None) is not None:
        return "--database-url"
    return "QKWATCH_DATABASE_URL" if os.environ.get("QKWATCH_DATABASE_URL") is not None else "the default"


def prepare_database(settings: Settings, source: str) -> None:
    """Connect and migrate; StartupError (one line, no password) when the URL or the database is unusable."""
    open_database(settings, source).dispose()


def open_database(settings: Settings, source: str) -> Engine:
    """An engine on the migrated database; StartupError (one line naming the URL, never its password, and
    where it came from) when the URL or the database is unusable."""
    quiet_alembic()
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from qkwatch.monitor.store.engine import make_engine
    from qkwatch.monitor.store.migrate import upgrade

    url = f"{redact(settings.database_url)} ({source})"
    try:
        engine = make_engine(settings.database_url, busy_timeout_ms=settings.sqlite_busy_timeout_ms)
    except (ValueError, ImportError, SQLAlchemyError) as exc:
        raise StartupError(f"database URL {url}: {first_line(exc)}") from None
    try:
        upgrade(engine)
    except (SQLAlchemyError, CommandError, OSError) as exc:
        engine.dispose()
        cause = getattr(exc, "orig", None) or exc
        raise StartupError(f"cannot use the database {url}: {first_line(cause)}") from None
    return engine


def quiet_alembic() -> None:
    """Alembic logs a line per plugin when it is first imported: keep a command's stderr to what matters."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def redact(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL SQLAlchemy can parse; still never print what may be a password
        return re.sub(r"://([^:/@]*):[^@]*@", r"://\1:***@", url)


def open_store(args: argparse.Namespace) -> Store:
    """The store on the migrated database of ``--database-url`` (else the settings); StartupError when the
    settings, the URL or the database are unusable."""
    engine = open_database(effective_settings(args), database_source(args))
    from qkwatch.monitor.store.store import Store  # after open_database has quietened alembic's import

    return Store(engine)
