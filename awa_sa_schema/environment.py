"""What ``env.py`` does, kept in the package so that it is imported (and type-checked) normally.

Alembic loads ``env.py`` by file path, outside any package, so that file is only a shim calling
:func:`run`.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context

URL_ENVIRONMENT_VARIABLE = "AWA_SA_DATABASE_URL"


def _database_url() -> str:
    """``-x url=...`` wins, then $AWA_SA_DATABASE_URL, then ``sqlalchemy.url`` from the ini."""
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get(URL_ENVIRONMENT_VARIABLE)
        or context.config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError(
            "no database: pass -x url=postgresql+psycopg://..., set "
            f"{URL_ENVIRONMENT_VARIABLE}, or set sqlalchemy.url in alembic.ini"
        )
    return url


def _migrate(connection: sa.Connection) -> None:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()


def run() -> None:
    """Run the migrations on the given connection, or on a fresh engine from the URL."""
    config = context.config
    if context.is_offline_mode():
        # The queue-storage revision inspects the database (which substrates exist), so there
        # is no faithful SQL script to emit.
        raise RuntimeError("the awa-sa fixture schema has no offline (--sql) mode")
    # Only the CLI path has an ini file; programmatic callers (pytest) keep their logging.
    if config.config_file_name is not None and config.attributes.get("configure_logger", True):
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    given = config.attributes.get("connection")
    if given is not None:
        _migrate(given)
        return
    engine = sa.create_engine(_database_url(), poolclass=sa.NullPool)
    try:
        with engine.connect() as connection:
            _migrate(connection)
    finally:
        engine.dispose()
