"""The invoicer's handler, tested with the awa-sa testing kit alone (no worker, no awa-pg).

``queue_storage_attempt`` seeds a job claimed on queue storage, the plane a fresh cluster's
worker puts every attempt on, and ``job_of`` gives the ``Job`` awa-pg would hand the handler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import invoicer
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from awa_sa import AttemptNotFound, Completed, Fail
from awa_sa.asyncio import running_attempts, settle
from awa_sa.testing import job_of, locate, queue_storage_attempt

ORDER = {"order_id": 42, "amount_cents": 1999}


async def delivered(args: Mapping[str, Any]) -> None:
    """The customer got the invoice."""


async def smtp_down(args: Mapping[str, Any]) -> None:
    raise ConnectionError("smtp.example.com refused the connection")


async def invoices(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    table = invoicer.invoices
    query = sa.select(table.c.order_id, table.c.job_id, table.c.attempt)
    async with engine.connect() as conn:
        return [tuple(row) for row in await conn.execute(query)]


@pytest.fixture
async def engine(awa_async_engine: AsyncEngine) -> AsyncEngine:
    await invoicer.create_tables(awa_async_engine)
    return awa_async_engine


async def test_the_invoice_commits_with_the_jobs_completion(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:  # a send_invoice job, as the worker claimed it
        mine = await conn.run_sync(queue_storage_attempt, kind="send_invoice", args=ORDER)
    outcome = await invoicer.send_invoice(engine, job_of(mine), delivered)
    assert outcome == Completed(mine.job_id)
    async with engine.connect() as conn:
        where = await conn.run_sync(locate, mine.job_id, schema=mine.storage)
    assert where is not None
    assert (where.schema, where.state) == ("awa", "completed")  # on queue storage, as in production
    assert await invoices(engine) == [(42, mine.job_id, 1)]


async def test_a_failed_delivery_leaves_no_invoice_and_the_attempt_running(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        mine = await conn.run_sync(queue_storage_attempt, kind="send_invoice", args=ORDER)
    with pytest.raises(ConnectionError):  # the worker retries the attempt with backoff
        await invoicer.send_invoice(engine, job_of(mine), smtp_down)
    assert await invoices(engine) == []
    assert [a.job_id for a in await running_attempts(engine)] == [mine.job_id]


async def test_an_attempt_settled_elsewhere_writes_no_invoice(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        mine = await conn.run_sync(queue_storage_attempt, kind="send_invoice", args=ORDER)
    await settle(engine, mine, Fail("rescued: deadline passed"))  # as a rescue would
    with pytest.raises(AttemptNotFound):
        await invoicer.send_invoice(engine, job_of(mine), delivered)
    assert await invoices(engine) == []
