"""The invoicer end to end on a real awa-pg runtime: migrate, start the worker, take orders.

A cluster built by awa-pg's migrations (what ``awa migrate`` runs), the worker started on it
before any job (so its runtime finalizes the cluster to queue storage), then the orders, each
saved with its job by awa-sa in its request's transaction, and one request that fails after
both were written. Every order
must have exactly its job and every job exactly its invoice: no order without its job, no job
of a request that failed, no completed job without its invoice, no invoice without its job's
completion, and a handler that raised halfway (its row written, its delivery failed) leaves
nothing of that attempt.

Skipped where awa-pg is not installed: a service's tests with the kit alone.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

import invoicer
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from awa_sa.asyncio import running_attempts
from awa_sa.testing import Location, locate
from awa_sa.testing.databases import Databases

awa = pytest.importorskip("awa", reason="awa-pg is not installed")
import invoicer_worker  # noqa: E402 -- imports awa

pytestmark = pytest.mark.slow  # awa-pg's migrations, a real runtime, a retry's backoff

ORDERS = {order_id: 1000 + order_id for order_id in range(1, 4)}
FLAKY = 2
"""The order whose first delivery fails, after its invoice row was written."""
DECLINED = 99
"""The order whose request fails after its order row and job were written."""
WAIT_SECS = 120.0
STILL = 3_600_000
"""A ring rotation interval (ms) past the end of the test, so no ring rotates: the runtime's
maintenance prunes a rotated ring's finished rows (a completion among them) within seconds, and
the test reads every job's end afterwards."""
ENDS = ("completed", "failed", "cancelled")


@pytest.fixture
async def migrated(awa_databases: Databases) -> AsyncIterator[str]:
    """A database that awa-pg's migrations built and nothing has run on yet: its libpq URL."""
    name = f"{awa_databases.template.removesuffix('_template')}_invoicer"
    with awa_databases.admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(awa_databases.url(name)).set(drivername="postgresql")
    libpq = url.render_as_string(hide_password=False)
    try:
        await awa.migrate(libpq)  # what `awa migrate` runs, in process: the slow part
        yield libpq
    finally:
        awa_databases.drop(name)


async def test_every_job_ends_with_exactly_its_invoice(migrated: str) -> None:
    engine = create_async_engine(sa.make_url(migrated).set(drivername="postgresql+psycopg"))
    await invoicer.create_tables(engine)
    deliveries: Counter[int] = Counter()

    async def deliver(args: Mapping[str, Any]) -> None:
        deliveries[args["order_id"]] += 1
        if args["order_id"] == FLAKY and deliveries[FLAKY] == 1:
            raise ConnectionError("smtp.example.com refused the connection")

    client = invoicer_worker.invoicer(migrated, engine, deliver)
    try:
        # The usual order: the worker starts on the fresh cluster, then the orders come.
        await client.start(
            [(invoicer.QUEUE, 4)],
            promote_interval_ms=100,
            queue_storage_queue_rotate_interval_ms=STILL,
            queue_storage_lease_rotate_interval_ms=STILL,
            queue_storage_claim_rotate_interval_ms=STILL,
        )
        assert await phase(engine) == ("active", "awa")  # finalized: queue storage, schema awa
        jobs: dict[int, int] = {}
        for order_id, amount in ORDERS.items():  # one request each, in its own transaction
            async with engine.begin() as conn:
                jobs[order_id] = await invoicer.take_order(conn, order_id, amount)
        declined: list[int] = []
        with pytest.raises(PaymentDeclined):
            await declined_request(engine, declined)
        ended = await until_ended(engine, list(jobs.values()), deliveries)
    finally:
        await client.shutdown()  # the runtime's own completions, after the handlers', flushed
        await client.close()
    async with engine.connect() as conn:
        orders = (await conn.execute(sa.select(invoicer.orders))).all()
        rows = (await conn.execute(sa.select(invoicer.invoices))).mappings().all()
        still_running = await running_attempts(conn)
        lost = await conn.run_sync(locate, declined[0], schema="awa")
    await engine.dispose()

    # Every order was saved with its job; the declined request left neither.
    assert {tuple(order) for order in orders} == {
        (order, amount, jobs[order]) for order, amount in ORDERS.items()
    }
    assert lost is None

    # Every job completed, and every invoice is its job's, written by the attempt that ended it.
    assert {order: where.state for order, where in ended.items()} == dict.fromkeys(
        ORDERS, "completed"
    )
    assert {r["order_id"]: (r["job_id"], r["attempt"], r["amount_cents"]) for r in rows} == {
        order: (jobs[order], ended[order].attempt, amount) for order, amount in ORDERS.items()
    }
    assert len(rows) == len(ORDERS)
    # The flaky order's first attempt raised after writing its row: that row never committed,
    # the runtime retried the attempt, and the second one wrote the invoice and ended the job.
    assert ended[FLAKY].attempt == 2
    assert deliveries == Counter({**dict.fromkeys(ORDERS, 1), FLAKY: 2})
    assert still_running == []


class PaymentDeclined(Exception):
    """The request failed after its order and job were written."""


async def declined_request(engine: AsyncEngine, job_ids: list[int]) -> None:
    """A request that takes order ``DECLINED``, notes its job's id in *job_ids*, then fails."""
    async with engine.begin() as conn:
        job_ids.append(await invoicer.take_order(conn, DECLINED, 1))
        raise PaymentDeclined(DECLINED)


async def phase(engine: AsyncEngine) -> tuple[Any, ...]:
    """The cluster's transition state and the schema it routes to."""
    async with engine.connect() as conn:
        query = sa.text("SELECT state, details->>'schema' FROM awa.storage_transition_state")
        return tuple((await conn.execute(query)).one())


async def until_ended(
    engine: AsyncEngine, job_ids: list[int], deliveries: Counter[int]
) -> dict[int, Location]:
    """Each job's row once every one has ended, by its order (enqueued in order)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_SECS
    while True:
        async with engine.connect() as conn:
            found = [await conn.run_sync(locate, job_id, schema="awa") for job_id in job_ids]
        ended = [where for where in found if where is not None and where.state in ENDS]
        if len(ended) == len(job_ids):
            return dict(zip(ORDERS, ended, strict=True))
        assert loop.time() < deadline, (found, deliveries)
        await asyncio.sleep(0.05)
