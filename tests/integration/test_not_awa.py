"""A database Awa never built gives awa-sa's own error, on every driver and form.

The first statement of a call (the one statement, which locks Awa's transition singleton and
moves the job) fails as a whole on a database without Awa's schema, and that failure is
reported as ``NotAnAwaDatabase`` rather than the driver's "relation does not exist". No
statement is added to find out: the happy path pays nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import DatabaseError, NotAnAwaDatabase, Snooze, reschedule_canonical_attempt
from awa_sa.core.driver_errors import translated

MESSAGE = r'^\[42P01\] not an Awa v040 database \(relation "awa.storage_transition_state"'


@pytest.fixture
def empty_url(clone_database: Callable[[str], str]) -> str:
    return clone_database("template0")


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2", "pg8000"])
def test_a_database_without_awa_is_named_as_such(empty_url: str, driver: str) -> None:
    engine = sa.create_engine(sa.make_url(empty_url).set(drivername=f"postgresql+{driver}"))
    try:
        with pytest.raises(NotAnAwaDatabase, match=MESSAGE) as raised:
            reschedule_canonical_attempt(engine, 1, 1, Snooze(1))
        assert isinstance(raised.value, DatabaseError)
        assert raised.value.sqlstate == "42P01"
        with engine.connect() as conn, pytest.raises(NotAnAwaDatabase, match="awa migrate"):
            reschedule_canonical_attempt(conn, 1, 1, Snooze(1))
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_a_database_without_awa_is_named_as_such_async(empty_url: str, driver: str) -> None:
    async def call() -> None:
        engine = create_async_engine(sa.make_url(empty_url).set(drivername=f"postgresql+{driver}"))
        try:
            with pytest.raises(NotAnAwaDatabase, match=MESSAGE):
                await awa_async.reschedule_canonical_attempt(engine, 1, 1, Snooze(1))
        finally:
            await engine.dispose()

    asyncio.run(call())


def test_a_missing_awa_function_is_named_too(engine: sa.Engine) -> None:
    """A schema older than v040: the singleton is there, the routing function is not."""
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP FUNCTION awa.active_queue_storage_schema() CASCADE")
    with pytest.raises(NotAnAwaDatabase, match=r"^\[42883\] not an Awa v040 database"):
        reschedule_canonical_attempt(engine, 1, 1, Snooze(1))


def test_other_missing_relations_stay_database_errors(engine: sa.Engine) -> None:
    with engine.connect() as conn, pytest.raises(DatabaseError) as raised, translated():
        conn.exec_driver_sql("SELECT * FROM awa_qs_elsewhere.jobs")
    assert not isinstance(raised.value, NotAnAwaDatabase)
