"""The bind forms: Engine, Connection and Session, each around the one flow (:mod:`awa_sa.flow`).

This is the only place that knows an ``Engine`` (own connection and transaction, committed) from
a ``Connection`` (the caller's transaction, never committed); a ``Session`` is the Connection
form on the connection of its current transaction. The async face (:mod:`awa_sa.asyncio`)
runs these same functions in SQLAlchemy's greenlet bridge rather than repeating them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy.exc import UnboundExecutionError

from awa_sa import flow
from awa_sa.calls import AnyCall, Call, EndCall
from awa_sa.drivers import check_dialect
from awa_sa.errors import CONNECTION_LOST, DatabaseError, ValidationError, translated
from awa_sa.internals import connect_isolation_level, driver_autocommit
from awa_sa.kinds import Ending

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")


def check_bind(bind: object) -> None:
    """Refuse, before any statement, a bind that is not a sync Engine, Connection or Session."""
    if isinstance(bind, Engine | Connection):
        check_dialect(bind.dialect, is_async=False)
    elif isinstance(bind, _session_types()):
        check_dialect(session_dialect(bind), is_async=False)
    else:
        name = type(bind).__name__
        hint = " (use awa_sa.asyncio for it)" if name.startswith("Async") else ""
        raise ValidationError(
            f"bind must be a sqlalchemy Engine, Connection or Session, got {name}{hint}"
        )


def session_dialect(session: Session) -> Dialect:
    """The dialect of the engine a (sync, or an async one's sync) Session runs on."""
    try:
        return session.get_bind().dialect
    except UnboundExecutionError as exc:
        raise ValidationError(f"the Session has no engine to run on: {exc}") from exc


def _session_types() -> tuple[type[Session], ...]:
    """``sqlalchemy.orm.Session``, if imported: a bind can be a Session only once it is.

    Importing the ORM costs 0.1 s, which a Core service should not pay for awa-sa.
    """
    orm = sys.modules.get("sqlalchemy.orm")
    return () if orm is None else (orm.Session,)


def within(bind: Engine | Connection | Session, calls: Sequence[AnyCall]) -> list[Ending]:
    """The Engine form (own connection and transaction, committed) or the Connection form.

    Also the AsyncEngine form, run whole in one greenlet by :mod:`awa_sa.asyncio`. The Engine
    form first sends the one statement alone in autocommit (one round trip, committed by
    itself); only when it moved nothing and says the call must go on does it open a
    transaction.
    """
    if not isinstance(bind, Engine | Connection):
        with translated():  # a Session's autobegin checks a connection out
            bind = bind.connection()
    if not isinstance(bind, Engine):
        return in_transaction(bind, calls)
    # Engine.begin() without its generator-based context manager; checkout, BEGIN and COMMIT
    # translated too.
    with translated(), bind.connect() as conn:
        if _alone_in_autocommit(bind):
            done = _alone(conn, calls)
            if done is not None:
                return done
        with conn.begin():
            return in_transaction(conn, calls)


def _alone(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending] | None:
    """The Engine form's statements alone in autocommit, or None to take a transaction.

    Re-schedules send the one statement, and go on in a transaction only when it says so. A
    single ending is one UPDATE, and comes back as the re-schedule it becomes when it is a
    retryable failure with attempts left. A batch with endings takes a transaction.
    """
    moving = [call for call in calls if isinstance(call, Call)]
    if len(moving) < len(calls):
        (ending,) = calls if len(calls) == 1 else (None,)
        if not isinstance(ending, EndCall):
            return None
        with driver_autocommit(conn) as switched:
            if not switched:
                return None
            (answer,) = _guarded(conn, lambda: flow.endings(conn, [ending]))
        if not isinstance(answer, Call):
            return [answer]
        moving = [answer]
    with driver_autocommit(conn) as switched:
        first = _guarded(conn, lambda: flow.alone(conn, moving)) if switched else None
    if isinstance(first, list):
        return list(first)
    conn.rollback()  # ends SQLAlchemy's autobegun transaction; nothing to send
    with conn.begin():  # the one statement said to go on: the two-statement path
        return list(_guarded(conn, lambda: flow.go_on(conn, moving)))


def in_transaction(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    """The flow inside whatever transaction *conn* has; the Connection and Session form."""
    return _guarded(conn, lambda: flow.settle(conn, calls))


_SEVERAL_EXCHANGES = frozenset({"pg8000"})
"""Drivers that send one statement with parameters as several exchanges (pg8000: Parse and
Sync, then Bind, Execute and Sync). Outside a transaction a transaction-pooling PgBouncer may
hand each exchange to a different server connection: seen binding our parameters to another
client's unnamed statement (08P01). Inside BEGIN the server connection stays ours."""


def _alone_in_autocommit(engine: Engine) -> bool:
    """May the one statement run alone in autocommit, as it would inside this engine's BEGIN?

    A lone statement is its own READ COMMITTED transaction; an engine set to another
    isolation level (or to AUTOCOMMIT, which the transaction path refuses) keeps the
    two-statement path, and so does a driver whose statement is not one exchange
    (:data:`_SEVERAL_EXCHANGES`).
    """
    if engine.dialect.driver in _SEVERAL_EXCHANGES:
        return False
    level = connect_isolation_level(engine)
    return level is None or level.upper().replace("_", " ") == "READ COMMITTED"


def _guarded(conn: Connection, flow_step: Callable[[], _T]) -> _T:
    """*flow_step* translated, invalidating a connection found dead on the way."""
    try:
        with translated():  # the statements, savepoints, and a connection that died midway
            return flow_step()
    except DatabaseError as exc:
        if exc.sqlstate == CONNECTION_LOST and not conn.invalidated:
            # Where SQLAlchemy did not notice, its next ROLLBACK (the caller's, or the Engine
            # form's own) would fail on the dead connection with a raw driver error.
            with suppress(Exception):
                conn.invalidate()
        raise
