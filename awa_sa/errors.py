"""One exception root, so a caller can catch everything awa-sa raises with one clause.

Validation errors are raised before any statement runs; database errors keep the driver's
exception as ``__cause__``.
"""

from __future__ import annotations


class AwaSAError(Exception):
    """Root of every error awa-sa raises."""


class ValidationError(AwaSAError, ValueError):
    """The input can never succeed; nothing was sent to the database."""


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
