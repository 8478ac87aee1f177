"""Shared plumbing for the fixture DDL: running raw SQL and vetting schema names.

The DDL is plain PostgreSQL text (function bodies, dollar quotes, ``%I`` in ``format``), so it is
sent to the driver untouched: no bind-parameter parsing by SQLAlchemy and no ``%`` placeholder
parsing by psycopg, either of which would mangle the bodies.
"""

from __future__ import annotations

import re

import sqlalchemy as sa

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

# The longest name the substrate derives from S is
# ``idx_<S>_lease_claim_closure_batches_7_receipt_ranges`` (S plus 49 characters). PostgreSQL
# silently truncates identifiers beyond 63 bytes, which would give indexes names that no longer
# embed S the way v040 does (and two of them the same name), so such names are refused up front.
MAX_SCHEMA_NAME_LENGTH = 63 - len("idx__lease_claim_closure_batches_7_receipt_ranges")


def run_sql(connection: sa.Connection, sql: str) -> None:
    """Execute one or more statements exactly as written."""
    connection.exec_driver_sql(sql, execution_options={"no_parameters": True})


def check_schema_name(schema: str) -> str:
    """Return *schema* if it is safe to splice into DDL and yields v040-shaped names.

    Raises ValueError otherwise. Names are spliced into identifiers and into string literals
    inside function bodies, so only a conservative lower-case identifier alphabet is allowed.
    """
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ValueError(
            f"invalid queue-storage schema name {schema!r}: must match {_SCHEMA_NAME.pattern}"
        )
    if schema.startswith("pg_"):
        raise ValueError(
            f"invalid queue-storage schema name {schema!r}: pg_ is reserved by PostgreSQL"
        )
    if len(schema) > MAX_SCHEMA_NAME_LENGTH:
        raise ValueError(
            f"queue-storage schema name {schema!r} is longer than {MAX_SCHEMA_NAME_LENGTH} "
            "characters: PostgreSQL would truncate the index names derived from it"
        )
    return schema


def ident(name: str) -> str:
    """Quote an already-vetted name, so that reserved words such as ``user`` still work."""
    return f'"{name}"'
