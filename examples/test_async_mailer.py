"""The async mailer's tests, on each async driver installed (psycopg 3; asyncpg with its extra).

pytest-asyncio (the testing extra brings it) runs the ``@pytest.mark.asyncio`` tests; the kit's
``awa_async_engine`` opens its connections on the driver ``awa_async_driver`` names, which this
module sets to each installed driver in turn.
"""

from __future__ import annotations

import pytest
from async_mailer import retry_later
from sqlalchemy.ext.asyncio import AsyncEngine

from awa_sa import CancelledDuplicate, Rescheduled, UniqueConflict
from awa_sa.testing import (
    contested_attempt,
    installed_async_drivers,
    locate,
    running_attempt,
    set_phase,
)


@pytest.fixture(params=installed_async_drivers())
def awa_async_driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.asyncio
async def test_a_retry_keeps_its_id_on_the_canonical_plane(awa_async_engine: AsyncEngine) -> None:
    async with awa_async_engine.begin() as conn:
        job_id, run_lease = await conn.run_sync(running_attempt, kind="send_email")
    outcome = await retry_later(awa_async_engine, job_id, run_lease)
    assert isinstance(outcome, Rescheduled)
    async with awa_async_engine.connect() as conn:
        where = await conn.run_sync(locate, job_id)
    assert where is not None
    assert (where.relation, where.job_id, where.state) == (
        "awa.scheduled_jobs",
        job_id,
        "retryable",
    )


@pytest.mark.asyncio
async def test_a_duplicate_conflicts_while_routing_is_canonical(
    awa_async_engine: AsyncEngine,
) -> None:
    async with awa_async_engine.begin() as conn:
        job = await conn.run_sync(contested_attempt, unique_key=b"ada@example.com")
    with pytest.raises(UniqueConflict):  # the attempt stays running until Awa rescues it
        await retry_later(awa_async_engine, job.job_id, job.run_lease)


@pytest.mark.asyncio
async def test_a_duplicate_is_cancelled_once_routing_flips(awa_async_engine: AsyncEngine) -> None:
    async with awa_async_engine.begin() as conn:
        job = await conn.run_sync(contested_attempt, unique_key=b"ada@example.com")
        await conn.run_sync(set_phase, "mixed_transition")  # routes new work to awa_qs
    outcome = await retry_later(awa_async_engine, job.job_id, job.run_lease)
    assert isinstance(outcome, CancelledDuplicate)
