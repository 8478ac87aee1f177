"""The tools' own errors: what ``awa-sa status`` and ``awa-sa demo`` refuse.

They share the library's root :class:`~awa_sa.core.errors.AwaSAError`, so the command line turns
any of them into one ``Error:`` line; they live here because the core never raises them.
"""

from __future__ import annotations

from awa_sa.core.errors import AwaSAError


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


class DemoUnavailable(AwaSAError, RuntimeError):
    """Something the demo needs (server binaries, the Alembic fixture) is not installed."""
