"""The Engine form's direct path: its try on a pooled connection, with no ``Connection``.

Most of the Engine form's client time used to be the ``Connection`` around its one
statement: building it, autobegin and its rollback, ``_execute_context``'s checks and
execution context, and the close. What a Connection does for our statement beyond the pool
and the driver's cursor is what its listeners, echo and execution options see. So where an
engine has none of them, the statement runs on the pooled connection itself:
``Engine.raw_connection()`` is the pool's public checkout (checkout and checkin events,
pre-ping, reset on return) and the cursor is the driver's. An error is what the Connection
would raise: a failed checkout goes through the Connection's own
``_handle_dbapi_exception_noconnection``, a failed statement is wrapped by
``DBAPIError.instance`` and a dead connection invalidated, with its pool, as
``Connection._handle_dbapi_exception`` does (``Pool._invalidate``; an interrupt invalidates
only the connection). An engine with a listener of any connection or dialect event
(OpenTelemetry's, a ``handle_error``), echo or INFO logging of ``sqlalchemy.engine``
(``Engine._should_log_info``, as the Connection asks), execution options, or a dialect whose
execution context handles a failed statement in a way the direct path does not reproduce
keeps the Connection. asyncpg's context does two things, both reproduced here
(:data:`_ASYNCPG`): it stamps the cursor with the time the dialect last saw the schema
change before each statement (``pre_exec``), and moves that time on when a statement fails
for a changed schema (``handle_dbapi_exception``), so that every connection prepares its
statements afresh. tests/integration/test_direct.py.

Where any private name this path needs moved (``lookup.PATHS.direct``; on asyncpg also
``asyncpg_context``), :func:`direct_allowed` answers no and the Engine form keeps the
Connection.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, NoReturn, cast

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.engine.default import DefaultExecutionContext
from sqlalchemy.engine.interfaces import DBAPICursor, ExecutionContext
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import await_only, is_exit_exception

from awa_sa.core.internals import lookup
from awa_sa.core.internals.lean import UNKNOWN, fetched, learned_row, row_type

__all__ = ["Direct", "checkin_idle", "checkout", "direct_allowed"]


def direct_allowed(engine: Engine) -> bool:
    """Whether no one would see what *engine*'s Connection does.

    ``Engine._has_events`` and ``Dialect._has_events`` are the flags the Connection itself
    reads before firing any event: set by the first listener of a connection event (on the
    engine or the Engine class) or a dialect event (``handle_error``, the ``do_*`` hooks).
    """
    dialect = engine.dialect
    return lookup.PATHS.direct and not (
        engine._has_events
        or dialect._has_events
        or engine.get_execution_options()
        or engine._should_log_info()
        or not _context_mirrored(dialect.execution_ctx_cls)
    )


def _context_mirrored(context: type[ExecutionContext]) -> bool:
    """Whether *context* does nothing with a failed statement's error, or what
    :class:`Direct` does for asyncpg's; a context that handles it its own way keeps the
    Connection, which calls it."""
    handling = context.handle_dbapi_exception
    if handling is _NO_HANDLING:
        return True
    return lookup.PATHS.asyncpg_context and handling is _asyncpg_handling()


_NO_HANDLING = DefaultExecutionContext.handle_dbapi_exception


def _asyncpg_handling() -> Any:
    """asyncpg's context's handling of a failed statement, when its dialect module is loaded
    (it is, for an engine on asyncpg)."""
    module = sys.modules.get("sqlalchemy.dialects.postgresql.asyncpg")
    context = getattr(module, "PGExecutionContext_asyncpg", None)
    return None if context is None else context.handle_dbapi_exception


def checkout(engine: Engine) -> PoolProxiedConnection:
    """A pooled connection of *engine*'s, or the error ``Engine.connect()`` would raise."""
    try:
        return engine.raw_connection()
    except engine.dialect.loaded_dbapi.Error as exc:
        Connection._handle_dbapi_exception_noconnection(exc, engine.dialect, engine)


def checkin_idle(fairy: PoolProxiedConnection) -> None:
    """Return *fairy*, whose driver connection has no transaction open, to its pool without
    the reset's ROLLBACK: as ``Connection.close()`` returns one whose transaction it has just
    ended, through the fairy's (undocumented) ``_close_special(transaction_reset=True)``. The
    checkin and reset events fire as ever (the reset told the transaction was reset). On the
    async adapters the ROLLBACK skipped is a greenlet switch even where the driver sends
    nothing. tests/integration/test_direct.py (the pool's events).
    """
    fairy._close_special(transaction_reset=True)


_ASYNCPG = "asyncpg"
"""The driver whose execution context's steps :class:`Direct` takes itself: the cursor
stamped with the dialect's schema time, the time moved on after a schema change."""
_PSYCOPG = "psycopg"
"""With ``is_async``: the driver whose lone statement :class:`Direct` sends on psycopg's own
``AsyncConnection``."""


def _schema_changed(dialect: Dialect) -> tuple[type[BaseException], ...]:
    """The errors after which asyncpg's context has every connection prepare afresh."""
    dbapi = dialect.loaded_dbapi
    return (dbapi.InvalidCachedStatementError, dbapi.InternalServerError)


async def _psycopg_alone(
    conn: Any, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]
) -> tuple[Any, list[Any]]:
    """*statement* alone in autocommit on psycopg's ``AsyncConnection``, switched back after:
    its cursor (whose ``description`` builds a ``Column`` per column each time it is read, so
    it is read only where a row class is to be learned) and its rows."""
    await conn.set_autocommit(True)
    try:
        cursor = await conn.execute(statement, parameters)
        return cursor, await cursor.fetchall() if cursor.pgresult.nfields else []
    finally:
        with suppress(Exception):  # a connection left in autocommit is invalidated by the caller
            await conn.set_autocommit(False)


_COMMIT_AS_QUERY = frozenset({"pg8000"})
"""Drivers whose ``commit()`` costs more exchanges than COMMIT sent as a plain query."""


class Direct:
    """A pooled connection that runs our statement texts on its own cursor.

    Stands where the flow's steps take a ``Connection`` for the statements of the Engine form's
    autocommit try (:func:`awa_sa.core.compiled.run` sends through :meth:`send`).
    """

    __slots__ = ("_asyncpg", "alone", "dialect", "engine", "fairy", "natively")

    def __init__(self, engine: Engine, fairy: PoolProxiedConnection) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        self.fairy = fairy
        self._asyncpg = self.dialect.driver == _ASYNCPG
        self.natively = self.dialect.is_async and (
            self.dialect.driver == _PSYCOPG or (self._asyncpg and lookup.PATHS.asyncpg_native)
        )
        """Whether a statement alone in autocommit goes by the driver's own API (asyncpg's
        only where its adapter's error translation was found: ``lookup.PATHS.asyncpg_native``)."""
        self.alone = False
        """Set by :func:`autocommit_on`: each statement is sent alone in autocommit."""

    @property
    def connection(self) -> PoolProxiedConnection:
        """The pooled connection, as ``Connection.connection`` is."""
        return self.fairy

    @property
    def invalidated(self) -> bool:
        return not self.fairy.is_valid

    def invalidate(self, exc: BaseException | None = None) -> None:
        if self.fairy.is_valid:
            self.fairy.invalidate(exc)

    def commit(self) -> None:
        """Commit the driver's transaction, as ``Connection.commit()`` would.

        pg8000's ``commit()`` sends COMMIT as an unnamed prepared statement, three exchanges
        with the server; on a cursor without parameters the same COMMIT is one simple query,
        and pg8000 reads the transaction's end from the server's answer either way.
        """
        if self.dialect.driver in _COMMIT_AS_QUERY:
            self.send("COMMIT", ())
            return
        try:
            self.dialect.do_commit(self.fairy)  # as the Connection does: on the pool's proxy
        except BaseException as exc:
            self._failed(exc, None, None, None)

    def send(self, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]) -> list[Any]:
        """*statement* with *parameters* on a cursor of its own, its rows fetched (alone in
        autocommit, by the async driver's own API: :meth:`_alone_natively`)."""
        if self.alone:
            return self._alone_natively(statement, parameters)
        cursor = self.fairy.cursor()
        if self._asyncpg:  # asyncpg's pre_exec
            stamp = self.dialect._invalidate_schema_cache_asof  # type: ignore[attr-defined]
            cursor._invalidate_schema_cache_asof = stamp  # type: ignore[attr-defined]
        try:
            cursor.execute(statement, parameters)
            return fetched(statement, cursor)
        except BaseException as exc:
            self._failed(exc, statement, parameters, cursor)
        finally:
            if self.fairy.is_valid:
                cursor.close()

    def _alone_natively(
        self, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]
    ) -> list[Any]:
        """*statement* alone in autocommit, by the async driver's own API on the pooled
        connection, in one await.

        SQLAlchemy's adapters take an await (a greenlet switch each way, and a coroutine run
        by the event loop's task) for each step: on psycopg 3 one to switch autocommit on, one
        for the statement and one to switch it back; on asyncpg the statement alone, through the
        adapter's own prepared-statement cache, an asyncio lock, the cursor description built
        per call and the status line parsed by a regular expression. Here asyncpg's ``fetch``
        runs it through asyncpg's own statement cache (``statement_cache_size`` in
        ``connect_args``, as docs/deploying.md sets it for PgBouncer), which re-prepares by
        itself once outside a transaction when a schema change broke the cached plan; psycopg's
        connection is switched, sent to and switched back in one coroutine
        (:func:`_psycopg_alone`). asyncpg's errors go through its adapter's translation (the
        undocumented ``_handle_exception``); psycopg's adapters raise psycopg's own. Then as
        any other. docs/performance.md#async-natively; tests/integration/test_direct.py.
        """
        driver: Any = self.fairy.driver_connection
        try:
            if self._asyncpg:
                try:
                    records = await_only(
                        driver.fetch(statement, *cast(tuple[Any, ...], parameters))
                    )
                except Exception as exc:
                    adapted: Any = self.fairy.dbapi_connection
                    adapted._handle_exception(exc)  # raises the adapter's error for it
                cursor = None
            else:
                cursor, records = await_only(_psycopg_alone(driver, statement, parameters))
        except BaseException as exc:
            self._failed(exc, statement, parameters, None)
        finally:
            if not self._asyncpg and driver.autocommit:  # not switched back: never pooled so
                self.invalidate()
        if not records:
            return []
        row = row_type(statement)
        if row is UNKNOWN:
            names = records[0].keys() if cursor is None else [c[0] for c in cursor.description]
            row = learned_row(statement, list(names))
        return list(map(row._make, records))

    def _failed(
        self,
        exc: BaseException,
        statement: str | None,
        parameters: Mapping[str, Any] | tuple[Any, ...] | None,
        cursor: DBAPICursor | None,
    ) -> NoReturn:
        """Raise what a Connection would for *exc*; invalidate where it would."""
        dialect, error = self.dialect, self.dialect.loaded_dbapi.Error
        exiting = is_exit_exception(exc)
        lost = exiting or (
            isinstance(exc, error)
            and dialect.is_disconnect(exc, self.fairy.dbapi_connection, cursor)
        )
        if lost and self.fairy.is_valid:
            if exiting:
                self.fairy.invalidate(exc)
            else:
                self.engine.pool._invalidate(self.fairy, exc)  # the pool's older ones too
        if not isinstance(exc, error):
            raise exc
        if self._asyncpg and isinstance(exc, _schema_changed(dialect)):
            dialect._invalidate_schema_cache()  # type: ignore[attr-defined]  # its context's
        raise DBAPIError.instance(
            statement,
            parameters,
            exc,
            error,
            hide_parameters=self.engine.hide_parameters,
            connection_invalidated=lost,
            dialect=dialect,
        ).with_traceback(exc.__traceback__) from exc
