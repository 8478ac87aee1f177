"""The settle's bind forms: the Engine form's autocommit try, then the one flow in a transaction.

An ``Engine`` owns its connection and transaction, committed; a ``Connection`` or ``Session``
lends the caller's (:mod:`awa_sa.core.binds`). The async face (:mod:`awa_sa.asyncio`)
runs these same functions in SQLAlchemy's greenlet bridge rather than repeating them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection

from awa_sa.core.binds import guarded
from awa_sa.core.compiled import Runner
from awa_sa.core.driver_errors import translated, translated_error
from awa_sa.core.internals import (
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
from awa_sa.settle import flow
from awa_sa.settle.inputs import AnyCall, Call, EndCall
from awa_sa.settle.results import Ending

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")
_C = TypeVar("_C")
_R = TypeVar("_R", bound=Runner)


def within(bind: Engine | Connection | Session, calls: Sequence[AnyCall]) -> list[Ending]:
    """The Engine form (own connection and transaction, committed) or the Connection form.

    Also the AsyncEngine form, run whole in one greenlet by :mod:`awa_sa.asyncio`. The Engine
    form first sends the one statement alone in autocommit (one round trip, committed by
    itself); only when it moved nothing and says the call must go on does it open a
    transaction. Where the statement may not run alone (:func:`_alone_in_autocommit`), the
    first try is BEGIN, the statement and COMMIT. Where no one would see the Connection (no
    listeners, echo or execution options: :func:`~awa_sa.core.internals.direct_allowed`), that
    first try runs on the pooled connection itself, in autocommit or in the driver's own
    transaction.

    The Engine form's checkout, BEGIN, COMMIT and checkin are translated by one ``try``, and
    :func:`~awa_sa.core.driver_errors.translated` is entered only when something was raised: on the
    path of every call a context manager costs a generator and four calls, and this one used to be
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
        (answer,) = guarded(runner, flow.endings, [ending])
        if not isinstance(answer, Call):
            return [answer]
        moving = [answer]
    first = guarded(runner, flow.alone, moving)
    if isinstance(first, list):
        return list(first)
    return _Then(_going_on, moving)  # the one statement said to go on: the two-statement path


def _going_on(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    return list(guarded(conn, flow.go_on, cast(Sequence[Call], calls)))


def in_transaction(conn: Connection, calls: Sequence[AnyCall]) -> list[Ending]:
    """The flow inside whatever transaction *conn* has; the Connection and Session form."""
    return guarded(conn, flow.settle, calls)


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
    (``awa_sa.core.internals.UNKNOWN_LEVEL``) and no pooled connection *fairy* is at hand to tell.
    """
    if engine.dialect.driver in _SEVERAL_EXCHANGES:
        return False
    level = connect_isolation_level(engine)
    if level == UNKNOWN_LEVEL:
        if fairy is None:
            return None
        level = driver_isolation_level(fairy)
    return level is None or level.upper().replace("_", " ") == "READ COMMITTED"
