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
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.pool import PoolProxiedConnection

from awa_sa import flow
from awa_sa.calls import AnyCall, Call, EndCall
from awa_sa.compiled import Runner
from awa_sa.drivers import check_dialect
from awa_sa.errors import CONNECTION_LOST, DatabaseError, ValidationError
from awa_sa.internals import (
    UNKNOWN_LEVEL,
    Direct,
    autocommit_off,
    autocommit_on,
    checkin_idle,
    checkout,
    connect_isolation_level,
    direct_allowed,
    driver_isolation_level,
    in_autocommit,
)
from awa_sa.kinds import Ending
from awa_sa.translation import translated, translated_error

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")
_C = TypeVar("_C")
_R = TypeVar("_R", bound=Runner)


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
    transaction. Where the statement may not run alone (:func:`_alone_in_autocommit`), the
    first try is BEGIN, the statement and COMMIT. Where no one would see the Connection (no
    listeners, echo or execution options: :func:`~awa_sa.internals.direct_allowed`), that
    first try runs on the pooled connection itself, in autocommit or in the driver's own
    transaction.

    The Engine form's checkout, BEGIN, COMMIT and checkin are translated by one ``try``, and
    :func:`~awa_sa.translation.translated` is entered only when something was raised: on the path
    of every call a context manager costs a generator and four calls, and this one used to be
    entered three times (docs/performance.md).
    """
    if not isinstance(bind, Engine):
        if not isinstance(bind, Connection):
            with translated():  # a Session's autobegin checks a connection out
                bind = bind.connection()
        return in_transaction(bind, calls)
    try:
        alone = _alone_in_autocommit(bind)
        if direct_allowed(bind):
            first = _direct(bind, calls, autocommit=alone)
        elif alone is False:
            with bind.begin() as conn:
                return in_transaction(conn, calls)
        else:
            with bind.connect() as conn:
                if alone is None and not _alone_in_autocommit(bind, conn.connection):
                    with conn.begin():
                        return in_transaction(conn, calls)
                first = _autocommit_try(conn, calls)
                if not isinstance(first, list):
                    conn.rollback()  # ends SQLAlchemy's autobegun transaction; nothing to send
                    with conn.begin():
                        return first.run(conn)
        if isinstance(first, list):
            return first
        with bind.begin() as conn:
            return first.run(conn)
    except Exception as exc:
        raise translated_error(exc)  # noqa: B904 -- translated() chained it already


@dataclass(frozen=True, slots=True)
class _Then:
    """What the Engine form's autocommit try leaves to a transaction: *step* on *calls*."""

    step: Callable[[Connection, Sequence[AnyCall]], list[Ending]]
    calls: Sequence[AnyCall]

    def run(self, conn: Connection) -> list[Ending]:
        return self.step(conn, self.calls)


def _direct(
    engine: Engine, calls: Sequence[AnyCall], *, autocommit: bool | None
) -> list[Ending] | _Then:
    """The first try on a pooled connection of *engine*'s, without a Connection: alone in
    autocommit where the one statement may run so (None: as the connection's level says),
    else in the driver's own transaction, committed when the try settled the call (what is
    left rolls back at checkin)."""
    fairy = checkout(engine)  # the pool's: its events, pre-ping
    if autocommit is None:
        autocommit = bool(_alone_in_autocommit(engine, fairy))
    idle = False  # known to have no transaction open: returned without the reset's ROLLBACK
    try:
        direct = Direct(engine, fairy)
        if autocommit:
            first = _autocommit_try(direct, calls)
            idle = True  # switched back (or invalidated), with nothing begun in autocommit
            return first
        if fairy.dbapi_connection is None or in_autocommit(direct):
            return _Then(in_transaction, calls)
        first = _alone(direct, calls)
        if isinstance(first, list):
            direct.commit()
            idle = True
        return first
    finally:
        if idle:
            checkin_idle(fairy)  # the checkin: its events, the reset's event
        else:
            fairy.close()  # the checkin: its events, the reset


def _autocommit_try(runner: Runner, calls: Sequence[AnyCall]) -> list[Ending] | _Then:
    """:func:`_alone` with *runner*'s driver connection in autocommit, switched back after."""
    dbapi = autocommit_on(runner)
    if dbapi is None:
        return _Then(in_transaction, calls)
    try:
        return _alone(runner, calls)
    finally:
        autocommit_off(runner, dbapi)


def _alone(runner: Runner, calls: Sequence[AnyCall]) -> list[Ending] | _Then:
    """The Engine form's statements alone in autocommit, or what to do in a transaction.

    Re-schedules send the one statement, and go on in a transaction only when it says so. A
    single ending is one UPDATE, and comes back as the re-schedule it becomes when it is a
    retryable failure with attempts left. A batch with endings takes a transaction.
    """
    moving = [call for call in calls if isinstance(call, Call)]
    if len(moving) < len(calls):
        ending = calls[0] if len(calls) == 1 else None
        if not isinstance(ending, EndCall):
            return _Then(in_transaction, calls)
        (answer,) = _guarded(runner, flow.endings, [ending])
        if not isinstance(answer, Call):
            return [answer]
        moving = [answer]
    first = _guarded(runner, flow.alone, moving)
    if isinstance(first, list):
        return list(first)
    return _Then(_going_on, moving)  # the one statement said to go on: the two-statement path


def _going_on(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    return list(_guarded(conn, flow.go_on, cast(Sequence[Call], calls)))


def administered(bind: Engine | Connection | Session, step: Callable[[Connection], _T]) -> _T:
    """An administering call's *step*: in its own transaction, committed, for an Engine (and
    an AsyncEngine's sync one); in the caller's transaction for a Connection or Session."""
    if isinstance(bind, Engine):
        try:
            with bind.begin() as conn:
                return administer_in(conn, step)
        except Exception as exc:
            raise translated_error(exc)  # noqa: B904 -- translated() chained it already
    if not isinstance(bind, Connection):
        with translated():  # a Session's autobegin checks a connection out
            bind = bind.connection()
    return administer_in(bind, step)


def administer_in(conn: Connection, step: Callable[[Connection], _T]) -> _T:
    """*step* inside whatever transaction *conn* has, translated; AUTOCOMMIT refused."""
    if in_autocommit(conn):
        # The routing lock would be gone before the write it guards.
        raise ValidationError("bind is in AUTOCOMMIT mode; administering jobs needs a transaction")
    return _guarded(conn, _step_on, step)


def _step_on(conn: Connection, step: Callable[[Connection], _T]) -> _T:
    return step(conn)


def in_transaction(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    """The flow inside whatever transaction *conn* has; the Connection and Session form."""
    return _guarded(conn, flow.settle, calls)


_SEVERAL_EXCHANGES = frozenset({"pg8000"})
"""Drivers that send one statement with parameters as several exchanges (pg8000: Parse and
Sync, then Bind, Execute and Sync). Outside a transaction a transaction-pooling PgBouncer may
hand each exchange to a different server connection: seen binding our parameters to another
client's unnamed statement (08P01). Inside BEGIN the server connection stays ours."""


def _alone_in_autocommit(engine: Engine, fairy: PoolProxiedConnection | None = None) -> bool | None:
    """May the one statement run alone in autocommit, as it would inside this engine's BEGIN?

    A lone statement is its own READ COMMITTED transaction; an engine set to another
    isolation level (or to AUTOCOMMIT, which the transaction path refuses) sends it inside
    BEGIN at that level, and so does a driver whose statement is not one exchange
    (:data:`_SEVERAL_EXCHANGES`). None where the engine's level is unknown
    (``awa_sa.internals.UNKNOWN_LEVEL``) and no pooled connection *fairy* is at hand to tell.
    """
    if engine.dialect.driver in _SEVERAL_EXCHANGES:
        return False
    level = connect_isolation_level(engine)
    if level == UNKNOWN_LEVEL:
        if fairy is None:
            return None
        level = driver_isolation_level(fairy)
    return level is None or level.upper().replace("_", " ") == "READ COMMITTED"


def _guarded(conn: _R, flow_step: Callable[[_R, _C], _T], calls: _C) -> _T:
    """``flow_step(conn, calls)`` translated, invalidating a connection found dead on the way."""
    try:  # the statements, savepoints, and a connection that died midway
        return flow_step(conn, calls)
    except Exception as exc:
        error = translated_error(exc)
        if (
            isinstance(error, DatabaseError)
            and error.sqlstate == CONNECTION_LOST
            and not conn.invalidated
        ):
            # Where SQLAlchemy did not notice, its next ROLLBACK (the caller's, or the Engine
            # form's own) would fail on the dead connection with a raw driver error.
            with suppress(Exception):
                conn.invalidate()
        raise error  # noqa: B904 -- translated() chained it already
