"""One exception root, so a caller can catch everything awa-sa raises with one clause.

* :class:`ValidationError` -- the input can never succeed. Raised before any statement runs
  where that is possible; otherwise (an invalid routing schema name, non-object metadata on the
  taken row) before anything is written, and the write that would follow is rolled back.
* :class:`UniqueConflict` -- SQLSTATE 23505, or a claim upsert that acquired nothing. On the
  canonical path it propagates and the attempt stays running, as in Awa (spec §4, §9).
* :class:`DatabaseError` -- any other driver error (interval overflow, lock timeout,
  serialization failure, lost connection). ``sqlstate`` is exposed; ``__cause__`` is the
  SQLAlchemy exception, whose ``orig`` is the driver's own.

Whatever is raised, nothing the operation did is committed. With an ``Engine`` its own
transaction is rolled back. With a ``Connection`` the caller's transaction is left either
untouched (the error came from a savepoint-wrapped queue-storage branch, or before any write) or
aborted by PostgreSQL (a failed canonical statement), and the caller must roll it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy.exc

UNIQUE_VIOLATION = "23505"


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

    ``sqlstate`` is None when the failure carried no SQLSTATE (a lost connection, or an
    expected row that was missing).
    """

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message if sqlstate is None else f"[{sqlstate}] {message}")
        self.sqlstate = sqlstate


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

    The constraint name of a 23505 comes from the server's diagnostics, so the claim trigger's
    ``idx_awa_jobs_unique`` and a ``*_pkey`` are told apart as Awa does.
    """
    orig = exc.orig
    sqlstate: str | None = getattr(orig, "sqlstate", None)
    diag = getattr(orig, "diag", None)
    if sqlstate == UNIQUE_VIOLATION:
        constraint: str | None = getattr(diag, "constraint_name", None)
        return UniqueConflict(constraint, str(orig).strip())
    primary: str | None = getattr(diag, "message_primary", None)
    return DatabaseError(primary or str(orig).strip(), sqlstate)


@contextmanager
def translated() -> Iterator[None]:
    """Let only awa-sa errors out: a caller catches one root, never a driver's exception.

    Covers what the flow does not execute itself too: BEGIN/COMMIT of the Engine form,
    SAVEPOINT/RELEASE/ROLLBACK TO, and SQLAlchemy's own refusals on a connection that died
    midway (``PendingRollbackError``, ``ResourceClosedError``), which carry no SQLSTATE.
    """
    try:
        yield
    except sqlalchemy.exc.DBAPIError as exc:
        raise translate_db_error(exc) from exc
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise DatabaseError(str(exc).strip()) from exc
