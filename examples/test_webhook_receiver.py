"""The webhook receiver end to end: a real awa-pg worker parks a charge on its callback, and a
real HTTP request to the receiver ends it, with its payment row, in one transaction.

A cluster built by awa-pg's migrations, its worker started first (queue storage, as a fresh
cluster runs), whose ``charge_card`` handler registers a callback, "sends" its id to the
provider (a dict here) with its signature, and parks. The receiver is served by uvicorn on a
local port; each callback is a real ``POST``. Then: a callback without the signature, or with
another callback's, refused with 401 and nothing written, its job still waiting; a paid
charge's job completed with exactly its payment row;
the provider's retry of the same webhook answered 409 and nothing written twice; a declined
charge failed with its row; and no charge ran again.

Skipped where awa-pg or the ``webhook`` extra (Starlette, uvicorn) is not installed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from awa_sa import CALLBACK_SIGNATURE_HEADER, sign_callback
from awa_sa.testing.databases import Databases

awa = pytest.importorskip("awa", reason="awa-pg is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the webhook extra is not installed")
pytest.importorskip("starlette", reason="the webhook extra is not installed")
import webhook_receiver  # noqa: E402 -- imports starlette

pytestmark = pytest.mark.slow  # awa-pg's migrations, a real runtime, a served app
WAIT_SECS = 120.0
SECRET = hashlib.sha256(b"the receiver's callback secret").digest()


@pytest.fixture
async def migrated(awa_databases: Databases) -> AsyncIterator[str]:
    """A database that awa-pg's migrations built and nothing has run on yet: its libpq URL."""
    name = f"{awa_databases.template.removesuffix('_template')}_webhook"
    with awa_databases.admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(awa_databases.url(name)).set(drivername="postgresql")
    libpq = url.render_as_string(hide_password=False)
    try:
        await awa.migrate(libpq)
        yield libpq
    finally:
        awa_databases.drop(name)


@pytest.fixture
def served(migrated: str) -> Iterator[str]:
    """The receiver served by uvicorn on a free local port, in a thread: its base URL."""
    url = sa.make_url(migrated).set(drivername="postgresql+psycopg")
    app = webhook_receiver.receiver(url.render_as_string(hide_password=False), SECRET)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(int(WAIT_SECS / 0.05)):
            if server.started:
                break
            threading.Event().wait(0.05)  # uvicorn's own start-up: no lock to watch
        else:
            raise AssertionError("uvicorn did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT_SECS)


def post(
    base: str, callback_id: str, body: dict[str, Any], signature: str | None
) -> tuple[int, dict[str, Any]]:
    """A real HTTP request, as the provider sends it: its status and JSON answer."""
    headers = {"Content-Type": "application/json"}
    if signature is not None:
        headers[CALLBACK_SIGNATURE_HEADER] = signature
    request = urllib.request.Request(
        f"{base}/callbacks/{callback_id}",
        data=json.dumps(body).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_SECS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


async def test_each_webhook_ends_its_job_with_exactly_its_payment_row(
    migrated: str, served: str
) -> None:
    sent: dict[int, str] = {}  # order -> the callback id given to the "provider"
    signed: dict[int, str] = {}  # order -> its signature, given with it
    charges: Counter[int] = Counter()
    client = awa.AsyncClient(migrated)

    async def charge_card(job: Any) -> Any:
        charges[job.args["order_id"]] += 1
        token = await job.register_callback(timeout_seconds=3600)
        signed[job.args["order_id"]] = sign_callback(SECRET, token.id)
        sent[job.args["order_id"]] = token.id  # the provider is told where to call back
        return awa.WaitForCallback(token)

    client.task(dict, kind=webhook_receiver.KIND, queue=webhook_receiver.QUEUE)(charge_card)
    await client.start([(webhook_receiver.QUEUE, 4)], promote_interval_ms=100)
    try:
        jobs = {}
        for order_id in (1, 2):
            job = await client.insert(
                {"order_id": order_id}, kind=webhook_receiver.KIND, queue=webhook_receiver.QUEUE
            )
            jobs[order_id] = job.id
        await until(lambda: set(sent) == {1, 2}, "both charges parked")
        await until_parked(migrated, len(jobs))

        refused = [
            await asyncio.to_thread(post, served, sent[1], {"status": "paid"}, signature)
            for signature in (None, signed[2], tampered(signed[1]), signed[1] + "0")
        ]
        waiting, rows_after_refused = await parked_and_paid(migrated)

        paid = await asyncio.to_thread(post, served, sent[1], {"status": "paid"}, signed[1])
        again = await asyncio.to_thread(post, served, sent[1], {"status": "paid"}, signed[1])
        declined = await asyncio.to_thread(
            post,
            served,
            sent[2],
            {"status": "declined", "reason": "insufficient funds"},
            signed[2].upper(),  # either case, as Awa reads hex
        )
        # A job enqueued after them runs, so a charge that ran again would have by then.
        sentinel = await client.insert(
            {"order_id": 3}, kind=webhook_receiver.KIND, queue=webhook_receiver.QUEUE
        )
        await until(lambda: 3 in sent, "the sentinel's charge")
        assert sentinel.id
    finally:
        await client.shutdown()
        await client.close()

    assert refused == [(401, {"error": "invalid callback signature"})] * 4
    assert (waiting, rows_after_refused) == (2, 0)
    assert paid == (
        200,
        {"order_id": 1, "status": "paid", "job_id": jobs[1], "job_state": "completed"},
    )
    assert again == (409, {"error": "no job waits on this callback"})
    assert declined == (
        200,
        {"order_id": 2, "status": "declined", "job_id": jobs[2], "job_state": "failed"},
    )
    engine = create_async_engine(sa.make_url(migrated).set(drivername="postgresql+psycopg"))
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(webhook_receiver.payments))).mappings().all()
            ended = await conn.execute(
                sa.text(
                    "SELECT job_id, state::text FROM awa.done_entries WHERE job_id = ANY(:ids)"
                ),
                {"ids": list(jobs.values())},
            )
            states = {int(job_id): str(state) for job_id, state in ended.all()}
    finally:
        await engine.dispose()
    assert {(r["order_id"], r["status"], r["job_id"], r["attempt"]) for r in rows} == {
        (1, "paid", jobs[1], 1),
        (2, "declined", jobs[2], 1),
    }
    assert states == {jobs[1]: "completed", jobs[2]: "failed"}
    assert charges == Counter({1: 1, 2: 1, 3: 1})


def tampered(signature: str) -> str:
    """The same signature with its last digit changed: still 64 hex digits."""
    return signature[:-1] + ("1" if signature[-1] == "0" else "0")


async def parked_and_paid(url: str) -> tuple[int, int]:
    """How many jobs wait on their callback, and how many payment rows there are."""
    engine = create_async_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))
    try:
        async with engine.connect() as conn:
            waiting = await conn.execute(
                sa.text("SELECT count(*) FROM awa.leases WHERE state = 'waiting_external'")
            )
            paid = await conn.execute(
                sa.select(sa.func.count()).select_from(webhook_receiver.payments)
            )
            return waiting.scalar_one(), paid.scalar_one()
    finally:
        await engine.dispose()


async def until(done: Any, what: str) -> None:
    for _ in range(int(WAIT_SECS / 0.05)):
        if done():
            return
        await asyncio.sleep(0.05)  # the worker's own pace
    raise AssertionError(f"{what}: not within {WAIT_SECS:.0f} s")


async def until_parked(url: str, count: int) -> None:
    """Until *count* jobs wait on their callback (the handler returned ``WaitForCallback``)."""
    engine = create_async_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))
    sql = sa.text("SELECT count(*) FROM awa.leases WHERE state = 'waiting_external'")
    try:
        for _ in range(int(WAIT_SECS / 0.05)):
            async with engine.connect() as conn:
                if (await conn.execute(sql)).scalar_one() >= count:
                    return
            await asyncio.sleep(0.05)  # the worker's own pace
    finally:
        await engine.dispose()
    raise AssertionError(f"{count} jobs did not park within {WAIT_SECS:.0f} s")
