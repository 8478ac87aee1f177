"""What a connection is in: how it was opened (or failed to be), its isolation level, its
driver's autocommit switch. Each by a driver's public attribute or a frame of the traceback,
except the isolation level ``create_engine`` was given, which SQLAlchemy keeps privately.
"""

from __future__ import annotations

import traceback
from enum import Enum
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.pool import PoolProxiedConnection

from awa_sa.core.internals import lookup
from awa_sa.core.internals.direct import Direct

__all__ = [
    "UNKNOWN_LEVEL",
    "autocommit_off",
    "autocommit_on",
    "connect_isolation_level",
    "driver_isolation_level",
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
    answer is :data:`UNKNOWN_LEVEL` unless an execution option names it: a connection of the
    engine's then tells (:func:`driver_isolation_level`).
    tests/integration/test_one_statement.py (isolation levels).
    """
    level = engine.get_execution_options().get("isolation_level")
    if level is None:
        if not lookup.PATHS.isolation:
            return UNKNOWN_LEVEL
        level = engine.dialect._on_connect_isolation_level
    return None if level is None else str(level)


_PSYCOPG2_LEVELS = {1: "READ COMMITTED", 2: "REPEATABLE READ", 3: "SERIALIZABLE"}
_PSYCOPG2_LEVELS[4] = "READ UNCOMMITTED"
"""psycopg2's ``isolation_level``, an int (psycopg's is an enum, by name)."""
_ABSENT: Any = object()


def driver_isolation_level(fairy: PoolProxiedConnection) -> str | None:
    """The isolation level *fairy*'s driver connection begins its transactions at, None for
    the server's default: read from the drivers' public attributes, with no round trip, where
    the engine's own setting cannot be read (:func:`connect_isolation_level`).

    SQLAlchemy sets the level ``create_engine`` was given on each new driver connection:
    psycopg's and psycopg2's ``isolation_level`` (on psycopg's ``AsyncConnection`` for the
    async dialect), or the asyncpg adapter's, which SQLAlchemy keeps itself. AUTOCOMMIT is the
    driver's ``autocommit`` switch. A driver with neither answers :data:`UNKNOWN_LEVEL`.
    tests/integration/test_one_statement.py (isolation levels, run with AWA_SA_PUBLIC_ONLY=1).
    """
    dbapi = fairy.dbapi_connection
    if dbapi is None:
        return UNKNOWN_LEVEL
    if getattr(dbapi, "autocommit", False):
        return "AUTOCOMMIT"
    level = getattr(fairy.driver_connection, "isolation_level", _ABSENT)
    if level is _ABSENT:
        level = getattr(dbapi, "isolation_level", _ABSENT)
    if level is None or isinstance(level, str):
        return level
    if isinstance(level, Enum):
        return level.name
    if isinstance(level, int):
        return _PSYCOPG2_LEVELS.get(level, UNKNOWN_LEVEL)
    return UNKNOWN_LEVEL


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
    ``awa_sa.settle.binds``) both switches are a flag set in the client, no round trip. A
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
