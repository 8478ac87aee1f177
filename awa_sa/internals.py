"""Every place awa-sa reaches past SQLAlchemy's or a driver's public API, each with its reason.

One module, so that a SQLAlchemy or driver upgrade has one place to look. Each use is covered
by the suite on every supported line (SQLAlchemy 2.0 and 2.1, every driver): the test named
beside it fails if the internal it relies on moves.
"""

from __future__ import annotations

import functools
import sys
import threading
import traceback
from collections import namedtuple
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any, NoReturn, TypeVar, cast

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.engine.default import DefaultExecutionContext
from sqlalchemy.engine.interfaces import DBAPICursor, ExecutionContext
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import NullType
from sqlalchemy.util import await_only, is_exit_exception

__all__ = [
    "Direct",
    "SchemaTranslatedFunction",
    "autocommit_off",
    "autocommit_on",
    "checkin_idle",
    "checkout",
    "connect_isolation_level",
    "direct_allowed",
    "in_autocommit",
    "lean_execute",
    "run_in_greenlet",
    "while_connecting",
]


_T = TypeVar("_T")

_DONE = object()
"""What a carrier switches back with once its function has returned or raised."""
_IDLE_CARRIERS = 8
"""Idle carriers kept per thread: as many as it has run awa-sa calls at once, up to this."""
_idle = threading.local()


async def run_in_greenlet(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``, run where SQLAlchemy's ``await_()`` can switch out of it, as
    ``sqlalchemy.util.greenlet_spawn`` (undocumented) and ``AsyncConnection.run_sync`` run it.

    The async faces run the sync flow so: an ``AsyncEngine`` call runs the whole Engine form
    (checkout, statement, checkin) in one greenlet, not one per step as ``async with
    engine.connect()`` would. ``greenlet_spawn`` makes a new greenlet for every call, and with
    it a new stack for its Python frames: mapped, faulted in and unmapped each time (a page
    fault per call; docs/performance.md#kept-greenlet says what that costs). The greenlet here
    is kept and reused. ``await_()`` asks two things of it, on SQLAlchemy 2.0 and 2.1 alike:
    the (undocumented) marker ``__sqlalchemy_greenlet_provider__``, and a parent that awaits
    what it is switched to and switches back with the result or throws the error in, which the
    loop below does as ``greenlet_spawn``'s does. ``fn`` runs in the caller's ``contextvars``
    context. tests/unit/test_greenlet_carrier.py.
    """
    carrier_type, current = _carriers()
    try:
        idle: list[Any] = _idle.carriers
    except AttributeError:  # the thread's first call
        idle = _idle.carriers = []
    carrier = idle.pop() if idle else carrier_type()
    caller = current()
    carrier.parent = caller
    carrier.gr_context = caller.gr_context
    step = carrier.switch(fn, args)
    while step is not _DONE:
        try:
            value = await step
        except BaseException:
            step = carrier.throw(*sys.exc_info())
        else:
            step = carrier.switch(value)
    value, error = carrier.outcome
    carrier.outcome = carrier.gr_context = None  # an idle carrier holds nothing of the call
    if len(idle) < _IDLE_CARRIERS:
        idle.append(carrier)
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]


@functools.cache
def _carriers() -> tuple[type[Any], Callable[[], Any]]:
    """The carrier greenlet's class, and ``greenlet.getcurrent``: made on first use, since
    greenlet is in the async extras only."""
    from greenlet import GreenletExit, getcurrent, greenlet  # noqa: PLC0415

    def serve(fn: Any, args: Any) -> None:
        """A carrier's run: every call it is switched to. It never holds itself (nor the call,
        once done) in a local, so that a carrier no one keeps is freed at once, ended by the
        GreenletExit greenlet raises in it, rather than left in a cycle, suspended."""
        while True:
            try:
                getcurrent().outcome = (fn(*args), None)
            except GreenletExit:
                raise
            except BaseException as exc:
                getcurrent().outcome = (None, exc)
            fn = args = None
            fn, args = getcurrent().parent.switch(_DONE)

    class Carrier(greenlet):  # type: ignore[misc]  # greenlet has no annotations
        __sqlalchemy_greenlet_provider__ = True
        outcome: tuple[Any, BaseException | None] | None = None

        def __init__(self) -> None:
            super().__init__(serve)

    return Carrier, getcurrent


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


# --- the lean execution of a statement's text (awa_sa.compiled.execute) ----------------------
#
# ``Connection.exec_driver_sql`` spends most of its client time after the statement has run:
# it builds a ``CursorResult`` and, for driver SQL, a new ``CursorResultMetaData`` from the
# cursor description on every call (per column: names, types, processors, the key map), which
# for the 7-column answer of the one statement costs more than the statement's own send and
# fetch on psycopg 3. Everything before it is kept: ``Connection._execute_context`` -- the same
# call ``exec_driver_sql`` makes -- checks the transaction, autobegins it, fires
# before_cursor_execute / after_cursor_execute with the statement text and parameters, echoes,
# and routes any error through ``_handle_dbapi_exception`` (translation, handle_error, the
# disconnect check, invalidation). Only the result differs: the execution context is the
# dialect's own class with ``_setup_result_proxy`` (the step that builds the CursorResult)
# replaced by one that fetches the rows (:func:`fetched`). Values are what the driver
# returned, as with driver SQL before (no result processing there either).
# tests/integration/test_compiled.py.


def _lean_result(self: DefaultExecutionContext) -> list[Any]:
    """``_setup_result_proxy`` of a lean context: the rows fetched, the cursor closed."""
    cursor = self.cursor
    rows = fetched(self.statement, cursor)
    cursor.close()
    return rows


def fetched(statement: str, cursor: DBAPICursor) -> list[Any]:
    """The rows *cursor* holds after running *statement*: tuples with named fields.

    Not a SQLAlchemy ``Result``: building one and reading its rows back through its key map
    was a third of what the flow adds to a call in the client. A named tuple reads as a
    ``Row`` does for the statements' readers (by position and by attribute). Its class is made
    from the cursor description once per statement text, whose answer has the same columns
    every time (psycopg 3 builds a ``Column`` object per column each time ``description`` is
    read).
    """
    row = _row_types.get(statement, _UNKNOWN)
    if row is _UNKNOWN:
        description = cursor.description
        row = _learned(statement, None if description is None else [c[0] for c in description])
    return [] if row is None else list(map(row._make, cursor.fetchall()))


def _learned(statement: str, names: list[str] | None) -> Any:
    """*statement*'s row class, kept: the named tuple of an answer with columns *names* (None
    for a statement without rows). An unlabelled column (or a name that is not an identifier)
    becomes ``_<position>``, and no reader reads it by name."""
    row = None if names is None else namedtuple("Row", names, rename=True)
    _row_types[statement] = row
    return row


_UNKNOWN: Any = object()
_row_types: dict[str, Any] = {}
"""Per statement text (ours are a bounded set): its answer's row class, None for no rows."""

_lean_contexts: dict[type[Any], type[DefaultExecutionContext]] = {}
"""The lean subclass of each dialect's execution context class."""


def _lean_context(dialect: Dialect) -> type[DefaultExecutionContext]:
    base = dialect.execution_ctx_cls
    lean = _lean_contexts.get(base)
    if lean is None:
        namespace = {"_setup_result_proxy": _lean_result, "__module__": __name__}
        lean = _lean_contexts[base] = type(f"Lean{base.__name__}", (base,), namespace)
    return lean


def lean_execute(
    conn: Connection, statement: str, parameters: Mapping[str, Any] | tuple[Any, ...]
) -> list[Any]:
    """``conn.exec_driver_sql(statement, parameters)``, answered by its rows (:func:`fetched`).

    ``_execute_context`` is declared to return a ``CursorResult``; the lean context makes it
    return the rows (tests/integration/test_compiled.py reads them both ways).
    """
    dialect = conn.dialect
    rows: list[Any] = conn._execute_context(  # type: ignore[assignment]  # the lean context's
        dialect,
        _lean_context(dialect)._init_statement,
        statement,
        None,
        conn._execution_options,
        statement,
        [parameters],
    )
    return rows


# --- the Engine form's direct path (awa_sa.forms) ---------------------------------------------
#
# Most of the Engine form's client time used to be the ``Connection`` around its one
# statement: building it, autobegin and its rollback, ``_execute_context``'s checks and
# execution context, and the close. What a Connection does for our statement beyond the pool
# and the driver's cursor is what its listeners, echo and execution options see. So where an
# engine has none of them, the statement runs on the pooled connection itself:
# ``Engine.raw_connection()`` is the pool's public checkout (checkout and checkin events,
# pre-ping, reset on return) and the cursor is the driver's. An error is what the Connection
# would raise: a failed checkout goes through the Connection's own
# ``_handle_dbapi_exception_noconnection``, a failed statement is wrapped by
# ``DBAPIError.instance`` and a dead connection invalidated, with its pool, as
# ``Connection._handle_dbapi_exception`` does (``Pool._invalidate``; an interrupt invalidates
# only the connection). An engine with a listener of any connection or dialect event
# (OpenTelemetry's, a ``handle_error``), echo or INFO logging of ``sqlalchemy.engine``
# (``Engine._should_log_info``, as the Connection asks), execution options, or a dialect whose
# execution context handles a failed statement in a way the direct path does not reproduce
# keeps the Connection. asyncpg's context does two things, both reproduced here
# (:data:`_ASYNCPG`): it stamps the cursor with the time the dialect last saw the schema
# change before each statement (``pre_exec``), and moves that time on when a statement fails
# for a changed schema (``handle_dbapi_exception``), so that every connection prepares its
# statements afresh. tests/integration/test_direct.py.


def direct_allowed(engine: Engine) -> bool:
    """Whether no one would see what *engine*'s Connection does.

    ``Engine._has_events`` and ``Dialect._has_events`` are the flags the Connection itself
    reads before firing any event: set by the first listener of a connection event (on the
    engine or the Engine class) or a dialect event (``handle_error``, the ``do_*`` hooks).
    """
    dialect = engine.dialect
    return not (
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
    return handling is _NO_HANDLING or handling is _asyncpg_handling()


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
    autocommit try (:func:`awa_sa.compiled.run` sends through :meth:`send`).
    """

    __slots__ = ("_asyncpg", "alone", "dialect", "engine", "fairy", "natively")

    def __init__(self, engine: Engine, fairy: PoolProxiedConnection) -> None:
        self.engine = engine
        self.dialect = engine.dialect
        self.fairy = fairy
        self._asyncpg = self.dialect.driver == _ASYNCPG
        self.natively = self.dialect.is_async and self.dialect.driver in (_ASYNCPG, _PSYCOPG)
        """Whether a statement alone in autocommit goes by the driver's own API."""
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
        row = _row_types.get(statement, _UNKNOWN)
        if row is _UNKNOWN:
            names = records[0].keys() if cursor is None else [c[0] for c in cursor.description]
            row = _learned(statement, list(names))
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
