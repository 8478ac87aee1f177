"""One exception root, so a caller can catch everything awa-sa raises with one clause.

* :class:`ValidationError` -- the input can never succeed. Raised before any statement runs
  where that is possible; otherwise (an invalid routing schema name, non-object metadata on the
  taken row) before anything is written, and the write that would follow is rolled back.
* :class:`UniqueConflict` -- SQLSTATE 23505, or a claim upsert that acquired nothing. On the
  canonical path it propagates and the attempt stays running, as in Awa (docs/contract.md#errors).
* :class:`NotAnAwaDatabase` -- a :class:`DatabaseError`: Awa's relations or functions are
  missing (42P01, 42883 on an ``awa.`` object), so the database was never built by ``awa migrate``.
* :class:`DatabaseError` -- any other driver error (interval overflow, lock timeout,
  serialization failure, lost connection). ``sqlstate`` is exposed; ``__cause__`` is the
  SQLAlchemy exception, whose ``orig`` is the driver's own. The SQLSTATE, constraint name and
  message are read the same way from every supported driver (:func:`server_report`).

Whatever is raised, nothing the operation did is committed. With an ``Engine`` its own
transaction is rolled back. With a ``Connection`` the caller's transaction is left either
untouched (the error came from a savepoint-wrapped queue-storage branch, or before any write) or
aborted by PostgreSQL (a failed canonical statement), and the caller must roll it back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy.exc

UNIQUE_VIOLATION = "23505"
UNDEFINED_OBJECTS = ("42P01", "42883")
"""PostgreSQL's undefined_table and undefined_function."""
_AWA_OBJECT = re.compile(r'\b"?awa\.')
"""An object of Awa's own schema named in the server's message (``relation "awa.jobs_hot"``)."""
CONNECTION_LOST = "08006"
"""The SQLSTATE of every lost connection (PostgreSQL's ``connection_failure``), on every driver.

Drivers disagree here: psycopg 3 reports the server's farewell (57P01 after
``pg_terminate_backend``), asyncpg its own 08003, psycopg2 and pg8000 nothing at all, and a
network failure gives no server code anywhere. One value lets a caller's retry policy treat
them alike; the driver's own exception stays available as ``__cause__``.
"""


class AwaSAError(Exception):
    """Root of every error awa-sa raises."""


class ValidationError(AwaSAError, ValueError):
    """The input can never succeed; nothing was written."""


class InvalidSchemaName(ValidationError):
    """A queue-storage schema name that is not a plain lower-case SQL identifier."""

    def __init__(self, schema: str) -> None:
        super().__init__(f"invalid SQL identifier: {schema!r}")
        self.schema = schema


class UniqueConflict(AwaSAError):
    """Another job holds the unique key (SQLSTATE 23505, or a claim upsert that wrote no row).

    On the canonical path this propagates and the attempt stays running, as in Awa.
    """

    def __init__(self, constraint: str | None, message: str = "") -> None:
        super().__init__(message or f"unique conflict on {constraint}")
        self.constraint = constraint


class DatabaseError(AwaSAError):
    """The database refused a statement for a reason other than a unique conflict.

    ``sqlstate`` is :data:`CONNECTION_LOST` for a lost connection whatever the driver, and
    None when the failure carried no SQLSTATE (an expected row that was missing, SQLAlchemy
    refusing a connection that already failed).
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message if sqlstate is None else f"[{sqlstate}] {message}")
        self.sqlstate = sqlstate


class NotAnAwaDatabase(DatabaseError):
    """A relation or function of Awa's schema is missing: not an Awa v040 database.

    Recognised from the error of the statement that needed it, the first one of a call (a read,
    so nothing was written), rather than checked beforehand: a check would cost every call a
    round trip to catch a mistake made once, when a service is first pointed at a database.
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(
            f"not an Awa v040 database ({message}); build it with `awa migrate` (awa-cli 0.6.x)",
            sqlstate,
        )


class StatusError(AwaSAError):
    """The database cannot be described as an Awa v040 cluster (``awa-sa status``)."""


class NotAnAwaCluster(StatusError):
    """No ``awa.schema_version`` table: ``awa migrate`` never ran against this database."""


class UnsupportedSchemaVersion(StatusError):
    """An Awa cluster, but not at the schema version awa-sa was written for."""

    def __init__(self, version: int | None, supported: int) -> None:
        shown = "no version rows" if version is None else f"v{version:03d}"
        super().__init__(f"Awa schema is {shown}; awa-sa supports v{supported:03d} (awa-cli 0.6.x)")
        self.version = version


class EmbeddedPostgresError(AwaSAError, RuntimeError):
    """The throwaway server could not be found, initialised or started."""


class UnusableServer(AwaSAError, RuntimeError):
    """The server given to the testing kit cannot host its databases (no CREATEDB, unreachable)."""


class DemoUnavailable(AwaSAError, RuntimeError):
    """Something the demo needs (server binaries, the Alembic fixture) is not installed."""


def translate_db_error(exc: sqlalchemy.exc.DBAPIError) -> AwaSAError:
    """The awa-sa error for a driver error; the caller raises it ``from exc``.

    The constraint name of a 23505 comes from the server's own report, so the claim trigger's
    ``idx_awa_jobs_unique`` and a ``*_pkey`` are told apart as Awa does. A connection that
    SQLAlchemy found dead is :data:`CONNECTION_LOST` on every driver, and so is an
    ``OperationalError`` the server did not report (no SQLSTATE): the driver lost the connection
    before SQLAlchemy could tell, as psycopg 3 can when the server closes the socket just as a
    statement is sent.
    """
    if exc.connection_invalidated:
        return connection_lost(exc.orig)
    report = server_report(exc.orig)
    if report.sqlstate is None and isinstance(exc, sqlalchemy.exc.OperationalError):
        return connection_lost(exc.orig)
    if report.sqlstate == UNIQUE_VIOLATION:
        return UniqueConflict(report.constraint, report.message)
    if report.sqlstate in UNDEFINED_OBJECTS and _AWA_OBJECT.search(report.message):
        return NotAnAwaDatabase(report.message, report.sqlstate)
    return DatabaseError(report.message, report.sqlstate)


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
    reset connection's first read through): the only I/O in the flow is the connection.
    """
    try:
        yield
    except sqlalchemy.exc.DBAPIError as exc:
        raise translate_db_error(exc) from exc
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise DatabaseError(str(exc).strip()) from exc
    except OSError as exc:
        raise connection_lost(exc) from exc
