"""What a connection is in: how it was opened (or failed to be), its isolation level, its
driver's autocommit switch. Each by a driver's public attribute or a frame of the traceback,
except the isolation level ``create_engine`` was given, which SQLAlchemy keeps privately.
"""

from __future__ import annotations

import traceback
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect, Engine

from awa_sa.internals import lookup
from awa_sa.internals.direct import Direct

__all__ = [
    "UNKNOWN_LEVEL",
    "autocommit_off",
    "autocommit_on",
    "connect_isolation_level",
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


UNKNOWN_LEVEL = "(unknown)"
"""The level :func:`connect_isolation_level` answers where it cannot read one: no level's name,
so a caller that needs READ COMMITTED does not assume it."""


def connect_isolation_level(engine: Engine) -> str | None:
    """The isolation level *engine* sets on each new connection, if one was asked for.

    ``create_engine(isolation_level=...)`` is kept only in the dialect's private
    ``_on_connect_isolation_level``; ``Engine.get_execution_options()`` shows only the
    execution-option form. Without the private attribute (``lookup.PATHS.isolation``) the
    answer is :data:`UNKNOWN_LEVEL` unless an execution option names it.
    tests/integration/test_one_statement.py (isolation levels).
    """
    level = engine.get_execution_options().get("isolation_level")
    if level is None:
        if not lookup.PATHS.isolation:
            return UNKNOWN_LEVEL
        level = engine.dialect._on_connect_isolation_level
    return None if level is None else str(level)


def in_autocommit(conn: Connection | Direct) -> bool:
    """Whether *conn*'s driver connection commits each statement by itself.

    Every supported driver's connection (or SQLAlchemy's async adapter of it) has an
    ``autocommit`` attribute; SQLAlchemy itself only knows the isolation level it set.
    """
    return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))


def autocommit_on(conn: Connection | Direct) -> Any | None:
    """*conn*'s driver connection switched to autocommit; None when it cannot be (no driver
    connection, or in autocommit already). :func:`autocommit_off` switches it back.

    Switched on the driver connection for this one statement, not through SQLAlchemy's
    ``isolation_level`` execution option, which would stay set on the Connection until checkin
    and then be reset by the dialect: the caller's engine and pool are left as they are, and on
    the drivers that take this path (psycopg 3, psycopg2; pg8000 never does, see
    ``awa_sa.forms``) both switches are a flag set in the client, no round trip. A
    :class:`Direct` on an async driver is not switched here: it sends each statement alone by
    the driver's own API (:meth:`Direct.send`). Two plain functions rather than a context
    manager: this is on the path of every Engine call. tests/integration/test_one_statement.py,
    tests/integration/test_forms.py.
    """
    dbapi = conn.connection.dbapi_connection
    if dbapi is None or getattr(dbapi, "autocommit", False):
        return None
    if isinstance(conn, Direct) and conn.natively:
        conn.alone = True
    else:
        dbapi.autocommit = True
    return dbapi


def autocommit_off(conn: Connection | Direct, dbapi: Any) -> None:
    """Back out of :func:`autocommit_on`; a connection that cannot be switched back is
    invalidated, never returned to the pool in autocommit."""
    if isinstance(conn, Direct) and conn.alone:
        conn.alone = False
        return
    try:
        dbapi.autocommit = False
    except Exception:  # whatever the driver raises, the connection goes
        conn.invalidate()
