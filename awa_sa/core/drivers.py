"""Which SQLAlchemy PostgreSQL drivers awa-sa runs on, checked before any statement.

Each driver below is exercised by the test suite against real databases; any other dialect or
driver is refused up front rather than failing halfway through with a driver's own error.
What differs between them is confined to two places: how values are laid out for the driver
(:mod:`awa_sa.core.compiled`) and how a driver's exception is read (:mod:`awa_sa.core.errors`). The
values the flow sends are plain Python values every driver accepts unprocessed: ints for integer
columns, floats for the delay, str for text and for JSON (cast to jsonb in SQL), lists for
arrays; values taken from a row are sent back to the same driver that returned them.
"""

from __future__ import annotations

from sqlalchemy.engine import Dialect

from awa_sa.core.errors import ValidationError

SYNC_DRIVERS = ("psycopg", "psycopg2", "pg8000")
"""Drivers for ``Engine``/``Connection`` binds (``postgresql+<driver>://``)."""

ASYNC_DRIVERS = ("psycopg", "asyncpg")
"""Drivers for ``AsyncEngine``/``AsyncConnection`` binds."""


def check_dialect(dialect: Dialect, is_async: bool) -> None:
    """Refuse a bind whose dialect is not PostgreSQL on a driver supported for this face."""
    if dialect.is_async and not is_async:
        raise ValidationError(
            f"bind uses the async driver {dialect.name}+{dialect.driver}; use awa_sa.asyncio "
            "with an AsyncEngine or AsyncConnection"
        )
    supported = ASYNC_DRIVERS if is_async else SYNC_DRIVERS
    if dialect.name == "postgresql" and dialect.driver in supported:
        return
    names = ", ".join(f"postgresql+{name}" for name in supported)
    face = "async (awa_sa.asyncio)" if is_async else "sync"
    raise ValidationError(
        f"bind uses {dialect.name}+{dialect.driver}, which awa-sa does not support; "
        f"supported {face} drivers: {names}"
    )
