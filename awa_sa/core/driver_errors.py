"""A driver's exception as awa-sa's: the one place driver errors are translated.

Every supported driver reports the same failure its own way (its exception classes, where the
SQLSTATE and constraint name live, whether a lost or refused connection has a code at all);
these functions read them alike and answer with the errors of :mod:`awa_sa.core.errors`, so a caller
catches one type per cause whatever driver its engine uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy.exc

from awa_sa.core.errors import (
    CANNOT_CONNECT,
    CONNECTION_LOST,
    READ_ONLY,
    UNDEFINED_OBJECTS,
    UNIQUE_VIOLATION,
    AwaSAError,
    DatabaseError,
    NotAnAwaDatabase,
    ReadOnlyTransaction,
    UniqueConflict,
)
from awa_sa.core.internals import while_connecting

_AWA_OBJECT = re.compile(r'\b"?awa\.')
"""An object of Awa's own schema named in the server's message (``relation "awa.jobs_hot"``)."""


def translate_db_error(exc: sqlalchemy.exc.DBAPIError) -> AwaSAError:
    """The awa-sa error for a driver error; the caller raises it ``from exc``.

    The constraint name of a 23505 comes from the server's own report, so the claim trigger's
    ``idx_awa_jobs_unique`` and a ``*_pkey`` are told apart as Awa does. A connection that
    could not be made is :func:`refused`. Once connected, a connection that SQLAlchemy found
    dead is :data:`CONNECTION_LOST` on every driver, and so is an ``OperationalError`` the
    server did not report (no SQLSTATE): the driver lost the connection before SQLAlchemy could
    tell, as psycopg 3 can when the server closes the socket just as a statement is sent.
    """
    if while_connecting(exc):
        return refused(exc.orig)
    if exc.connection_invalidated:
        return connection_lost(exc.orig)
    report = server_report(exc.orig)
    if report.sqlstate is None and isinstance(exc, sqlalchemy.exc.OperationalError):
        return connection_lost(exc.orig)
    if report.sqlstate == UNIQUE_VIOLATION:
        return UniqueConflict(report.constraint, report.message)
    if report.sqlstate == READ_ONLY:
        return ReadOnlyTransaction(report.message, READ_ONLY)
    if report.sqlstate in UNDEFINED_OBJECTS and _AWA_OBJECT.search(report.message):
        return NotAnAwaDatabase(report.message, report.sqlstate)
    return DatabaseError(report.message, report.sqlstate)


_LIBPQ_REFUSAL = re.compile(r"connection to server (?:at|on socket) .*? failed: (?:FATAL:  )?(.*)")
_REFUSAL_CODES = (
    ("database .* does not exist", "3D000"),
    ("role .* does not exist", "28000"),
    ("role .* is not permitted to log in", "28000"),
    ("no pg_hba.conf entry", "28000"),
    ("pg_hba.conf rejects", "28000"),
    ("password authentication failed", "28P01"),
    ("the database system is (?:shutting down|starting up|in recovery mode|not )", "57P03"),
    ("sorry, too many clients|too many connections|remaining connection slots", "53300"),
    ("database .* is not currently accepting connections", "55000"),
    ("permission denied for database", "42501"),
    ("unsupported startup parameter", "08P01"),  # PgBouncer's, for a startup `options`
)
"""The server's (and PgBouncer's) refusals at start-up, as libpq reports them, in English.

libpq keeps no SQLSTATE for a connection it could not open, only the server's text, so
psycopg 3 and psycopg2 carry none; pg8000 and asyncpg keep the server's code. These messages
are PostgreSQL's own (``postinit.c``, ``auth.c``, ``postmaster.c``); a server whose
``lc_messages`` is not English gives :data:`CANNOT_CONNECT` instead on those two drivers.
"""


def refused(orig: BaseException | None) -> DatabaseError:
    """A connection that could not be made: the server's code when it sent one, else 08001."""
    report = server_report(orig)
    message = report.message.split("\n", 1)[0]
    sqlstate = report.sqlstate
    libpq = _LIBPQ_REFUSAL.search(message)
    if sqlstate is None and libpq is not None:
        message = libpq.group(1)
        sqlstate = next((c for p, c in _REFUSAL_CODES if re.match(p, message)), None)
    if sqlstate is None:
        return DatabaseError(f"cannot connect: {message}", CANNOT_CONNECT)
    return DatabaseError(message, sqlstate)


def connection_lost(orig: BaseException | None) -> DatabaseError:
    """A lost connection, whatever the driver said about it (its first line is kept)."""
    first_line = _text(orig).split("\n", 1)[0]
    return DatabaseError(f"connection lost: {first_line}", CONNECTION_LOST)


@dataclass(frozen=True, slots=True)
class ServerReport:
    """What the server said about a failed statement, whichever driver carried it."""

    sqlstate: str | None
    constraint: str | None
    message: str


def server_report(orig: BaseException | None) -> ServerReport:
    """Read SQLSTATE, constraint name and message out of a driver exception.

    * psycopg 3 and psycopg2 expose the server's fields as ``diag``;
    * pg8000 passes the raw ErrorResponse fields, keyed by their protocol letters
      (``C`` SQLSTATE, ``n`` constraint, ``M`` message, ``D`` detail), as ``args[0]``;
    * SQLAlchemy's asyncpg adapter copies only the SQLSTATE onto its own exception; asyncpg's
      exception, with ``constraint_name``, ``message`` and ``detail``, is its ``__cause__``.

    An error raised by the driver itself carries no SQLSTATE (except asyncpg's own codes for
    client-side refusals); its text is the message.
    """
    diag = getattr(orig, "diag", None)
    if diag is not None:
        return _report(
            diag.sqlstate, diag.constraint_name, diag.message_primary, diag.message_detail, orig
        )
    fields = orig.args[0] if orig is not None and orig.args else None
    if isinstance(fields, dict):
        return _report(fields.get("C"), fields.get("n"), fields.get("M"), fields.get("D"), orig)
    cause = orig.__cause__ if orig is not None else None
    sqlstate = getattr(orig, "sqlstate", None)
    if cause is not None and sqlstate is not None and getattr(cause, "sqlstate", None) == sqlstate:
        return _report(
            sqlstate,
            getattr(cause, "constraint_name", None),
            getattr(cause, "message", None),
            getattr(cause, "detail", None),
            orig,
        )
    return _report(sqlstate, None, None, None, orig)


def _report(
    sqlstate: str | None,
    constraint: str | None,
    primary: str | None,
    detail: str | None,
    orig: BaseException | None,
) -> ServerReport:
    """The message as psycopg 3 renders it: the primary text, then the detail line if any."""
    if not primary:
        return ServerReport(sqlstate, constraint, _text(orig))
    message = f"{primary}\nDETAIL:  {detail}" if detail else primary
    return ServerReport(sqlstate, constraint, message)


def _text(orig: BaseException | None) -> str:
    return str(orig).strip() if orig is not None else ""


@contextmanager
def translated() -> Iterator[None]:
    """Let only awa-sa errors out: a caller catches one root, never a driver's exception.

    Covers what the flow does not execute itself too: BEGIN/COMMIT of the Engine form,
    SAVEPOINT/RELEASE/ROLLBACK TO, and SQLAlchemy's own refusals on a connection that died
    midway (``PendingRollbackError``, ``ResourceClosedError``), which carry no SQLSTATE.
    ``OSError`` is a socket failing under a driver that does not wrap it (pg8000 lets a
    reset connection's first read through, asyncpg a refused connect): the only I/O in the
    flow is the connection.
    """
    try:
        yield
    except sqlalchemy.exc.DBAPIError as exc:
        raise translate_db_error(exc) from exc
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise DatabaseError(str(exc).strip()) from exc
    except OSError as exc:  # asyncpg's refused connect, pg8000's reset socket
        raise (refused(exc) if while_connecting(exc) else connection_lost(exc)) from exc


def translated_error(exc: Exception) -> Exception:
    """*exc* as :func:`translated` lets it out (itself when already ours).

    For the paths of every call, which enter :func:`translated` only once something was
    raised: a call that succeeds never pays for the context manager.
    """
    try:
        with translated():
            raise exc
    except Exception as out:  # handed back, to be raised by the caller
        return out
    return exc  # not reached: translated() lets every exception out
