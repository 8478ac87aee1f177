"""Every place awa-sa reaches past SQLAlchemy's or a driver's public API, each with its reason.

One module, so that a SQLAlchemy or driver upgrade has one place to look. Each use is covered
by the suite on every supported line (SQLAlchemy 2.0 and 2.1, every driver): the test named
beside it fails if the internal it relies on moves.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import NullType

# sqlalchemy.util.greenlet_spawn is not documented. It runs a sync function in a greenlet
# that AsyncConnection's awaits can switch out of: the AsyncEngine form runs the whole sync
# Engine form (checkout, the flow, COMMIT, checkin) in one, where the public way (`async with
# engine.begin()`, then run_sync) costs five greenlet switches and event-loop rounds more.
# tests/integration/test_async_engine_form.py.
from sqlalchemy.util import greenlet_spawn

__all__ = [
    "SchemaTranslatedFunction",
    "connect_isolation_level",
    "driver_autocommit",
    "greenlet_spawn",
    "in_autocommit",
    "while_connecting",
]


def while_connecting(exc: BaseException) -> bool:
    """Whether *exc* was raised while a dialect opened a connection (checkout, pre-ping's
    reconnect, a Connection revalidating itself), not during a call on an open one.

    SQLAlchemy raises both kinds alike, and drivers reuse their exception types; only where
    the error came from tells them apart, so the traceback is read for the frame of a
    ``Dialect.connect`` (the method every dialect opens its DBAPI connection in).
    tests/integration/test_connection_errors.py.
    """
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_name == "connect" and isinstance(frame.f_locals.get("self"), Dialect):
            return True
    return False


def connect_isolation_level(engine: Engine) -> str | None:
    """The isolation level *engine* sets on each new connection, if one was asked for.

    ``create_engine(isolation_level=...)`` is kept only in the dialect's private
    ``_on_connect_isolation_level``; ``Engine.get_execution_options()`` shows only the
    execution-option form. tests/integration/test_one_statement.py (isolation levels).
    """
    level = engine.get_execution_options().get("isolation_level")
    level = level or getattr(engine.dialect, "_on_connect_isolation_level", None)
    return None if level is None else str(level)


def in_autocommit(conn: Connection) -> bool:
    """Whether *conn*'s driver connection commits each statement by itself.

    Every supported driver's connection (or SQLAlchemy's async adapter of it) has an
    ``autocommit`` attribute; SQLAlchemy itself only knows the isolation level it set.
    """
    return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))


@contextmanager
def driver_autocommit(conn: Connection) -> Iterator[bool]:
    """The driver connection in autocommit for the block; yields False when it cannot be.

    Switched on the driver connection for this one statement, not through SQLAlchemy's
    ``isolation_level`` execution option, which would stay set on the Connection until checkin
    and then be reset by the dialect: the caller's engine and pool are left as they are, and on
    the drivers that take this path (psycopg 3, psycopg2, asyncpg's adapter; pg8000 never does,
    see ``awa_sa.forms``) both switches are a flag set in the client, no round trip. A
    connection that cannot be switched back is invalidated, never returned to the pool in
    autocommit.
    tests/integration/test_one_statement.py, tests/integration/test_forms.py.
    """
    dbapi = conn.connection.dbapi_connection
    if dbapi is None or in_autocommit(conn):
        yield False
        return
    dbapi.autocommit = True
    try:
        yield True
    finally:
        try:
            dbapi.autocommit = False
        except Exception:
            conn.invalidate()


class SchemaTranslatedFunction(FunctionElement[None]):
    """A SQL function under a schema that ``schema_translate_map`` renders, as a table's is.

    ``sqlalchemy.func`` cannot put a function under a translated schema. A FunctionElement
    whose (undocumented) ``_use_schema_map`` is set has its ``schema`` resolved by the
    compiler's ``preparer.schema_for_object``, as a table's is. Subclasses set ``name`` and
    ``schema``. tests/unit/test_statements.py (the lane sequences under ``awa_qs``).
    """

    type = NullType()
    inherit_cache = True
    _use_schema_map = True


@compiles(SchemaTranslatedFunction)
def _compile_schema_translated(
    element: SchemaTranslatedFunction, compiler: SQLCompiler, **kw: Any
) -> str:
    preparer = compiler.preparer
    schema = preparer.quote_schema(preparer.schema_for_object(element))
    return f"{schema}.{element.name}({compiler.process(element.clauses, **kw)})"
