"""The AsyncEngine form runs checkout, BEGIN, the flow, COMMIT and checkin in one greenlet.

That is cheaper than ``async with engine.begin()`` (five greenlets and a task), and must not
change what a caller sees: the events on ``async_engine.sync_engine`` fire as before, a failure
rolls back and returns the connection, and a task cancelled while it waits writes nothing,
leaks no pooled connection, and leaves the engine usable.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from jobs import canonical_state, insert_holder, insert_job
from racing import DEFAULT_TIMEOUT, HeldTransaction, blocked_by
from recording import recording
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import awa_sa.asyncio as awa_async
from awa_sa import Rescheduled, Snooze, UniqueConflict


def _new_job(engine: sa.Engine, **kw: Any) -> int:
    with engine.begin() as conn:
        return insert_job(conn, **kw)


def checked_out(async_engine: AsyncEngine) -> int:
    """Connections out of the pool now: every call must have given its own back."""
    pool = async_engine.sync_engine.pool
    assert isinstance(pool, sa.pool.QueuePool)  # the async engine's default, which counts them
    return pool.checkedout()


@pytest.fixture
def seen(async_engine: AsyncEngine) -> Iterator[list[str]]:
    """What a tracer hooked on the sync engine records: statements' first words, BEGIN, ..."""
    events = ("begin", "commit", "rollback", "checkout", "checkin")
    with recording(async_engine.sync_engine, events=events) as out:
        yield out


async def test_events_fire_in_order_and_the_connection_goes_back(
    engine: sa.Engine, async_engine: AsyncEngine, seen: list[str]
) -> None:
    job = _new_job(engine)
    await awa_async.reschedule_canonical_attempt(async_engine, _new_job(engine), 1, Snooze(1))
    seen.clear()
    outcome = await awa_async.reschedule_canonical_attempt(async_engine, job, 1, Snooze(1))
    assert isinstance(outcome, Rescheduled)
    # One statement in autocommit: SQLAlchemy ends its autobegun transaction, nothing is sent.
    assert seen == ["CHECKOUT", "BEGIN", "WITH", "ROLLBACK", "CHECKIN"]
    assert checked_out(async_engine) == 0
    assert canonical_state(engine, job) is None


async def test_a_failure_rolls_back_and_returns_the_connection(
    engine: sa.Engine, async_engine: AsyncEngine, seen: list[str]
) -> None:
    job = _new_job(engine, unique_key=b"k", unique_states="11000000")
    with engine.begin() as conn:
        insert_holder(conn, b"k", "11000000")
    with pytest.raises(UniqueConflict):
        await awa_async.reschedule_canonical_attempt(async_engine, job, 1, Snooze(5))
    assert seen[-2:] == ["ROLLBACK", "CHECKIN"]
    assert "COMMIT" not in seen
    assert checked_out(async_engine) == 0
    assert canonical_state(engine, job) == "running"


@pytest.fixture(params=["psycopg", "asyncpg"])
async def either_async_engine(
    request: pytest.FixtureRequest, db_url: str
) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine on each async driver (the one statement runs alone in autocommit, so a
    cancelled wait must be cancelled on the server too)."""
    url = sa.make_url(db_url).set(drivername=f"postgresql+{request.param}")
    engine = create_async_engine(url, pool_size=10, max_overflow=10)
    try:
        yield engine
    finally:
        await engine.dispose()


async def test_a_task_cancelled_while_waiting_writes_nothing_and_leaks_nothing(
    engine: sa.Engine, either_async_engine: AsyncEngine
) -> None:
    async_engine = either_async_engine
    job = _new_job(engine)
    holder = HeldTransaction(engine)
    holder.execute("SELECT 1 FROM awa.storage_transition_state WHERE singleton FOR UPDATE")
    call = asyncio.create_task(
        awa_async.reschedule_canonical_attempt(async_engine, job, 1, Snooze(1))
    )
    try:
        deadline = asyncio.get_running_loop().time() + DEFAULT_TIMEOUT
        while not blocked_by(engine, holder.pid):
            assert not call.done(), call
            assert asyncio.get_running_loop().time() < deadline, "the call never waited"
            await asyncio.sleep(0.005)  # lets the call reach its lock wait
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        holder.rollback()
    assert canonical_state(engine, job) == "running"
    assert checked_out(async_engine) == 0
    outcome = await awa_async.reschedule_canonical_attempt(async_engine, job, 1, Snooze(1))
    assert isinstance(outcome, Rescheduled)
