"""An awa-pg service's handler that settles its own attempt: the invoice and the job's end
commit together.

Awa's worker claims a ``send_invoice`` job and calls the handler. The handler records the
invoice in the service's own table and completes the job **in one transaction**: find the
attempt (``attempt_of``), write the row, deliver, settle (``settle``), commit. A crash or an
exception anywhere before the commit leaves neither the row nor the completion, and the
attempt still running: Awa retries it as it retries any failed handler, and the retry writes
the row once. A completion without its invoice, or an invoice of a job that did not end, cannot
happen.

The producer is the same idea on the other side: ``take_order`` writes the order and enqueues
its ``send_invoice`` job (``awa_sa.asyncio.enqueue``) in the request's transaction, so an order
is never saved without its job, nor a job enqueued for an order that was rolled back.

The attempt is on queue storage on a cluster that ``awa migrate`` built and whose worker
started first (the usual order); ``attempt_of`` finds it on either plane. The worker wiring
is ``invoicer_worker.py``; ``test_invoicer.py`` tests both sides with the testing kit alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from awa_sa import Complete, Completed, Stale
from awa_sa.asyncio import attempt_of, enqueue, settle

KIND = "send_invoice"
QUEUE = "billing"

metadata = sa.MetaData()

orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    # The job that invoices this order, enqueued in the transaction that saved it.
    sa.Column("invoice_job_id", sa.BigInteger, nullable=False),
)

invoices = sa.Table(
    "invoices",
    metadata,
    sa.Column("order_id", sa.BigInteger, primary_key=True),
    sa.Column("amount_cents", sa.BigInteger, nullable=False),
    # The job and the attempt that sent it: the attempt that settled the job, always.
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("sent_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)

Deliver = Callable[[Mapping[str, Any]], Awaitable[None]]
"""Sends the invoice to the customer (mail, a billing API); raises when it cannot."""


class AlreadySettled(Exception):
    """The attempt was settled elsewhere (a rescue, a cancel): its invoice must not commit."""


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


async def take_order(conn: AsyncConnection, order_id: int, amount_cents: int) -> int:
    """The web request's part, in the request's transaction: the order and its invoice job.

    Nothing is committed here: the caller's ``engine.begin()`` commits both, or neither when
    the request fails after this call. Returns the job's id.
    """
    job = await enqueue(
        conn, {"order_id": order_id, "amount_cents": amount_cents}, kind=KIND, queue=QUEUE
    )
    await conn.execute(
        orders.insert().values(id=order_id, amount_cents=amount_cents, invoice_job_id=job.id)
    )
    return job.id


async def send_invoice(engine: AsyncEngine, job: Any, deliver: Deliver) -> Completed:
    """The handler's work for one awa-pg ``Job``: the invoice row and the job's completion.

    An exception from *deliver* rolls the row back and reaches the worker, which retries the
    attempt with backoff as it retries any failed handler.
    """
    async with engine.begin() as conn:  # one transaction: the invoice and the completion
        mine = await attempt_of(conn, job)  # this job's running attempt, on either plane
        await conn.execute(
            invoices.insert().values(
                order_id=job.args["order_id"],
                amount_cents=job.args["amount_cents"],
                job_id=job.id,
                attempt=job.attempt,
            )
        )
        await deliver(job.args)
        outcome = await settle(conn, mine, Complete())
        if isinstance(outcome, Stale):  # settled elsewhere since attempt_of: write nothing
            raise AlreadySettled(job.id)
    assert isinstance(outcome, Completed)  # Complete() ends in Completed or Stale
    return outcome
