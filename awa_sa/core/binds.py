"""The bind forms every verb shares: which binds are accepted, and a step in a transaction.

An ``Engine`` gets its own transaction, committed; a ``Connection`` or ``Session`` lends the
caller's, never committed. Every verb's step runs through :func:`guarded`, so a driver's error
reaches the caller as awa-sa's and a connection found dead is invalidated before the caller's
ROLLBACK meets it. The settle adds its autocommit shortcut on top (:mod:`awa_sa.settle.binds`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy.exc import UnboundExecutionError

from awa_sa.core.compiled import Runner
from awa_sa.core.driver_errors import translated, translated_error
from awa_sa.core.drivers import check_dialect
from awa_sa.core.errors import CONNECTION_LOST, DatabaseError, ValidationError
from awa_sa.core.internals import in_autocommit

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
    return guarded(conn, _step_on, step)


def _step_on(conn: Connection, step: Callable[[Connection], _T]) -> _T:
    return step(conn)


def guarded(conn: _R, flow_step: Callable[[_R, _C], _T], calls: _C) -> _T:
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
