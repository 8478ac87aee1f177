"""A payment provider's webhook, received in one transaction with the job that waits on it.

An awa-pg handler charges a card: it registers a callback (``register_callback``), hands its id
to the provider with the charge, and parks (``WaitForCallback``); the job is then
``waiting_external``. When the provider calls back, this ASGI app (Starlette) writes the
payment's row and ends the waiting job **in the same transaction**: ``complete_external`` for a
paid charge, ``fail_external`` for a declined one. Both commit together or not at all: no
completed job without its payment row, no payment row whose job still waits and would charge
again after its callback timeout.

The handler also hands the provider the callback id's signature (``awa_sa.sign_callback``, the
scheme Awa's own HTTP worker uses), which the provider sends back in the ``X-Awa-Signature``
header. The app checks it (``awa_sa.verify_callback``) before it opens a transaction: a request
without it, or with another, is answered 401 and nothing is written, so only a caller given
the signature with the callback id can end its job.

A callback that finds no wait (the provider's retry of a webhook already handled, or a wait the
timeout rescue or a cancel ended first) gets ``None``: the app rolls its row back and answers
409, so each charge is recorded exactly once whatever the provider retries.

Needs the ``webhook`` extra (Starlette, and uvicorn to serve it): ``pip install
'awa-sa[async,webhook]'``. Serve it with ``uvicorn webhook_receiver:app`` and
``$DATABASE_URL`` (SQLAlchemy's, ``postgresql+psycopg://...``) and
``$AWA_CALLBACK_HMAC_SECRET`` (the 32-byte secret the handler signs with, as 64 hex digits).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from awa_sa import CALLBACK_SIGNATURE_HEADER, verify_callback
from awa_sa.asyncio import complete_external, fail_external

KIND = "charge_card"
QUEUE = "payments"

metadata = sa.MetaData()

payments = sa.Table(
    "payments",
    metadata,
    sa.Column("order_id", sa.BigInteger, primary_key=True),
    sa.Column("status", sa.Text, nullable=False),
    # The job the callback ended, and the attempt that had parked on it.
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)


class AlreadyHandled(Exception):
    """No wait on this callback: its row must not commit."""


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


async def receive(engine: AsyncEngine, callback_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The payment's row and the waiting job's end, in one transaction; raises
    ``AlreadyHandled`` (after the rollback) when no job waits on *callback_id*."""
    async with engine.begin() as conn:
        paid = body["status"] == "paid"
        if paid:
            job = await complete_external(conn, callback_id, body)
        else:
            job = await fail_external(conn, callback_id, f"declined: {body.get('reason', '')}")
        if job is None:
            raise AlreadyHandled(callback_id)  # rolls back with the transaction
        row = {"order_id": job.args["order_id"], "status": body["status"], "job_id": job.id}
        await conn.execute(payments.insert().values(**row, attempt=job.attempt))
        return {**row, "job_state": job.state}


def receiver(database_url: str, secret: bytes) -> Starlette:
    """The app: ``POST /callbacks/{callback_id}`` with the provider's JSON body
    (``{"status": "paid"}`` or ``{"status": "declined", "reason": ...}``) and the callback id's
    signature under *secret* in the ``X-Awa-Signature`` header."""
    state: dict[str, AsyncEngine] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["engine"] = create_async_engine(database_url)
        await create_tables(state["engine"])
        try:
            yield
        finally:
            await state["engine"].dispose()

    async def callback(request: Request) -> JSONResponse:
        callback_id = request.path_params["callback_id"]
        signature = request.headers.get(CALLBACK_SIGNATURE_HEADER, "")
        if not verify_callback(secret, callback_id, signature):
            return JSONResponse({"error": "invalid callback signature"}, status_code=401)
        body = await request.json()
        try:
            done = await receive(state["engine"], callback_id, body)
        except AlreadyHandled:
            return JSONResponse({"error": "no job waits on this callback"}, status_code=409)
        return JSONResponse(done)

    routes = [Route("/callbacks/{callback_id}", callback, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


if "DATABASE_URL" in os.environ:  # `uvicorn webhook_receiver:app`
    app = receiver(
        os.environ["DATABASE_URL"], bytes.fromhex(os.environ["AWA_CALLBACK_HMAC_SECRET"])
    )
