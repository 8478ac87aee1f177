"""Install and remove the canonical plane (schema ``awa``) of the v040 fixture."""

from __future__ import annotations

import sqlalchemy as sa

from . import canonical_functions, canonical_tables
from ._sql import run_sql


def install_canonical(connection: sa.Connection) -> None:
    """Create schema ``awa`` with the canonical tables, functions, triggers and seed rows.

    Tables come before functions because the trigger DDL names both; the routing functions
    only need the tables at call time, but keeping one order makes failures easy to place.
    """
    for ddl in canonical_tables.ALL + canonical_functions.ALL:
        run_sql(connection, ddl)


def uninstall_canonical(connection: sa.Connection) -> None:
    """Drop schema ``awa`` and everything in it, including the default queue-storage substrate."""
    run_sql(connection, "DROP SCHEMA IF EXISTS awa CASCADE;")
