"""The testing kit's own errors: the server it provisions, never the reschedule.

They share the library's root :class:`~awa_sa.core.errors.AwaSAError`, so the plugin turns any of
them into one failure line; they live here because the core never raises them.
"""

from __future__ import annotations

from awa_sa.core.errors import AwaSAError


class EmbeddedPostgresError(AwaSAError, RuntimeError):
    """The throwaway server could not be found, initialised or started."""


class UnusableServer(AwaSAError, RuntimeError):
    """The server given to the testing kit cannot host its databases (no CREATEDB, unreachable)."""
