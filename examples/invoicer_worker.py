"""The invoicer as an awa-pg worker: a real runtime, the handler of ``invoicer.py``.

Start the worker before anything is enqueued on a cluster ``awa migrate`` has just built, and
its runtime finalizes the cluster to queue storage (schema ``awa``) as it starts, so every
attempt is a queue-storage receipt: the handler settles it with ``attempt_of`` and ``settle``.

The producer needs no awa-pg: ``invoicer.take_order`` enqueues with awa-sa in the request's
transaction. Run as a script, the worker serves
``$DATABASE_URL`` until interrupted: ``python invoicer_worker.py``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import awa
import sqlalchemy as sa
from invoicer import KIND, QUEUE, Deliver, create_tables, send_invoice
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def invoicer(database_url: str, engine: AsyncEngine, deliver: Deliver) -> awa.AsyncClient:
    """An awa-pg client whose ``send_invoice`` handler is the invoicer's; start it to run."""
    client = awa.AsyncClient(database_url)

    @client.task(dict, kind=KIND, queue=QUEUE)
    async def handle(job: awa.Job[dict[str, Any]]) -> None:
        # Settled by the handler; the runtime's own completion then finds nothing to do.
        await send_invoice(engine, job, deliver)

    return client


async def serve(database_url: str, deliver: Deliver) -> None:
    """The worker, until cancelled; *database_url* is libpq's (``postgres://...``)."""
    url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
    engine = create_async_engine(url)
    await create_tables(engine)
    client = invoicer(database_url, engine, deliver)
    try:
        await client.start([(QUEUE, 4)])
        await asyncio.Event().wait()
    finally:
        await client.shutdown()
        await client.close()
        await engine.dispose()


async def print_invoice(args: Any) -> None:
    print(f"invoice for order {args['order_id']}: {args['amount_cents'] / 100:.2f}")


if __name__ == "__main__":
    asyncio.run(serve(os.environ["DATABASE_URL"], print_invoice))
