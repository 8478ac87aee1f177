"""Programmatic ``alembic upgrade head`` for tests, and where the substrate names come from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from ._sql import check_schema_name
from .queue_storage import install_queue_storage

SCRIPT_LOCATION = Path(__file__).resolve().parent
QUEUE_STORAGE_SCHEMAS_ATTRIBUTE = "awa_sa_queue_storage_schemas"
QS_SCHEMA_X_ARGUMENT = "qs_schema"


def queue_storage_schemas(config: Config, x_arguments: dict[str, str]) -> tuple[str, ...]:
    """The substrate names a run should materialise: ``awa`` first, then the extra names.

    Programmatic callers pass names through ``config.attributes``; the CLI passes
    ``-x qs_schema=a,b``. ``awa`` is always included because v040 always has its default
    substrate there. Every name is vetted, so a bad one fails before any DDL runs.
    """
    given = config.attributes.get(QUEUE_STORAGE_SCHEMAS_ATTRIBUTE)
    if given is None:
        raw = x_arguments.get(QS_SCHEMA_X_ARGUMENT, "")
        given = [name.strip() for name in raw.split(",") if name.strip()]
    names = ["awa"]
    for name in given:
        if check_schema_name(str(name)) not in names:
            names.append(str(name))
    return tuple(names)


def build(connection: sa.Connection, queue_storage_schemas: Sequence[str] = ("awa",)) -> None:
    """Bring the database behind *connection* to the fixture's head revision.

    Runs ``alembic upgrade head`` on this connection (no ini file, so logging is left alone),
    materialising the substrate for ``awa`` and every extra name. On a database already at head
    it installs only the substrates that are missing, so calling it again with a new name is how
    an existing fixture database gains a schema. A connection without an open transaction is
    committed, as Alembic does; inside the caller's transaction nothing is committed.
    """
    names = [check_schema_name(name) for name in queue_storage_schemas]
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["connection"] = connection
    config.attributes[QUEUE_STORAGE_SCHEMAS_ATTRIBUTE] = tuple(names)
    command.upgrade(config, "head")
    caller_owns_transaction = connection.in_transaction()
    for name in names:
        install_queue_storage(connection, name)
    if not caller_owns_transaction:
        connection.commit()
