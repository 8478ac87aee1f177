"""``resolve_callback`` in the caller's transaction writes what awa-pg 0.6.9's writes.

Twin clusters per phase (canonical, mixed_transition, active), their jobs parked by a real
awa-pg handler that registered its callback with CEL expressions (a ``filter``, an
``on_fail``, an ``on_complete`` and a ``transform``; :mod:`callback_waits`). Each resolve runs
by awa-pg's ``AsyncClient`` on one twin and by awa-sa, in a caller's transaction that also
commits a business row, on the other: every row of every table of the phase's schemas and
every sequence changed alike, the same NOTIFYs, the same answer, for each outcome (completed
by the expressions with the transform, failed by ``on_fail``, ignored by the filter, and each
default action), on waits with a unique key, a flushed progress and either receipt shape. A
rolled back resolve leaves every row as it was; the async twin runs through asyncpg, and the
call through psycopg2, pg8000 and an ORM Session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import awa
import pytest
import sqlalchemy as sa
from administering import change, pg_call, snapshot, twins
from callback_waits import CHANNELS, PHASES, Parked, parked_twins, same_answer
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = pytest.mark.slow  # real awa-pg runtimes

CEL = {
    "filter": "payload.kind == 'charge'",
    "on_fail": "payload.status == 'declined'",
    "on_complete": "payload.status == 'paid' && payload.amount > 0u",
    "transform": "{'paid': payload.amount, 'order': payload.order, 'n': size(payload.items)}",
}
PAID = {"kind": "charge", "status": "paid", "amount": 1250, "order": "A-1", "items": [1, 2]}
DECLINED = {"kind": "charge", "status": "declined", "amount": 1250}
REFUND = {"kind": "refund", "status": "paid", "amount": 1250}
PENDING = {"kind": "charge", "status": "pending"}
JOBS: tuple[dict[str, Any], ...] = (
    # The options of each job, by number: its expressions, and what each resolve hands it.
    {"cel": CEL, "unique_opts": {"by_args": True}, "tags": ["t"], "metadata": {"m": 1}},  # 1
    {"cel": CEL, "progress": True},  # 2 declined
    {"cel": CEL, "unique_opts": {"by_args": True}},  # 3 filtered
    {"cel": CEL, "unique_opts": {"by_args": True}, "metadata": {"m": 4}},  # 4 default complete
    {"cel": CEL, "progress": True},  # 5 default fail
    {"tags": ["plain"]},  # 6 no expressions, default ignore
    {"cel": CEL, "queue": "cbc_q", "tags": ["c"]},  # 7 paid, a compact receipt where one is
    {"cel": CEL, "queue": "cbc_q"},  # 8 declined
    {"cel": CEL},  # 9 rolled back
    {"cel": CEL},  # 10 the async twin
    {"cel": CEL},  # 11 psycopg2
    {"cel": CEL},  # 12 pg8000
    {"cel": CEL},  # 13 an ORM Session
    {"cel": CEL},  # 14 resolved twice
)
RESOLVES = {
    "paid-keyed": (1, PAID, "ignore", "completed"),
    "declined-progress": (2, DECLINED, "ignore", "failed"),
    "filtered": (3, REFUND, "complete", "ignored"),
    "default-complete": (4, PENDING, "complete", "completed"),
    "default-fail": (5, PENDING, "fail", "failed"),
    "no-expressions": (6, PAID, "ignore", "ignored"),
    "paid-compact": (7, PAID, "ignore", "completed"),
    "declined-compact": (8, DECLINED, "ignore", "failed"),
}
ROLLED_BACK, ASYNC, TWICE = 9, 10, 14
FORMS = {"psycopg2": 11, "pg8000": 12, "session": 13}


@pytest.fixture(scope="module", params=PHASES)
def parked(
    request: pytest.FixtureRequest,
    pg: EmbeddedPostgres,
    awa_databases: Databases,
    real_template: str,
) -> Iterator[Parked]:
    with parked_twins(pg, awa_databases, real_template, request.param, JOBS) as made:
        yield made


def waiting_on(parked: Parked, side: int, n: int) -> str:
    """The callback id the *n*-th job waits on, on twin *side*."""
    callback = parked.callback_id(side, n)
    assert callback is not None
    return callback


def on_pg(callback: str, payload: Any, default: str) -> Any:
    """awa-pg's resolve, "callback not found" read as None."""

    async def call(client: awa.AsyncClient) -> Any:
        try:
            return await client.resolve_callback(callback, payload, default)
        except awa.CallbackNotFound:
            return None

    return call


@pytest.mark.parametrize(("n", "payload", "default", "outcome"), RESOLVES.values(), ids=RESOLVES)
def test_a_resolve_writes_what_awa_pg_writes(
    parked: Parked, n: int, payload: Any, default: str, outcome: str
) -> None:
    ids = waiting_on(parked, 0, n), waiting_on(parked, 1, n)
    theirs, got, changed, notes = twins(
        parked.urls,
        parked.engines,
        on_pg(ids[0], payload, default),
        lambda conn: awa_sa.resolve_callback(conn, ids[1], payload, default),  # type: ignore[arg-type]
        schemas=parked.schemas,
        channels=CHANNELS,
    )
    assert got is not None
    assert got.outcome == outcome
    same_answer(got, theirs)
    assert notes == []
    if outcome == "ignored":
        assert changed == {}
        return
    assert changed
    assert got.job.state == outcome
    if outcome == "completed" and default == "ignore":
        assert got.payload == {"n": 2, "order": "A-1", "paid": 1250}  # the transform's
    if outcome == "failed":
        (entry,) = got.job.errors
        named = entry["error"] == "callback failed: on_fail expression matched"
        assert entry.get("expression") == (CEL["on_fail"] if named else None)
        assert named == (payload is DECLINED)


def test_a_second_resolve_finds_no_callback_as_in_awa_pg(parked: Parked) -> None:
    ids = waiting_on(parked, 0, TWICE), waiting_on(parked, 1, TWICE)
    for _ in range(2):
        theirs, got, changed, _ = twins(
            parked.urls,
            parked.engines,
            on_pg(ids[0], PAID, "ignore"),
            lambda conn: awa_sa.resolve_callback(conn, ids[1], PAID),
            schemas=parked.schemas,
            channels=CHANNELS,
        )
    assert (theirs, got, changed) == (None, None, {})


def test_a_rolled_back_resolve_leaves_the_wait_as_it_was(parked: Parked) -> None:
    engine = parked.engines[1]
    callback = waiting_on(parked, 1, ROLLED_BACK)
    before = snapshot(engine, parked.schemas)
    for payload, default, outcome in ((PAID, "ignore", "completed"), (PENDING, "fail", "failed")):
        with engine.connect() as conn:
            conn.execute(sa.text("INSERT INTO public.business VALUES ('rolled back')"))
            got = awa_sa.resolve_callback(conn, callback, payload, default)  # type: ignore[arg-type]
            assert got is not None
            assert got.outcome == outcome
            conn.rollback()
        assert change(before, snapshot(engine, parked.schemas)) == {}


def test_the_async_twin_resolves_with_asyncpg(parked: Parked) -> None:
    """On one twin only: a completion rolled back, then a failure by ``on_fail`` committed."""
    url = sa.make_url(parked.urls[1]).set(drivername="postgresql+asyncpg")
    callback = waiting_on(parked, 1, ASYNC)

    async def calls() -> tuple[Any, Any]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                completed = await awa_async.resolve_callback(conn, callback, PAID)
                await conn.rollback()
            async with engine.begin() as conn:
                failed = await awa_async.resolve_callback(conn, callback, DECLINED)
            return completed, failed
        finally:
            await engine.dispose()

    completed, failed = asyncio.run(calls())
    assert (completed.outcome, completed.payload["paid"], completed.job.state) == (
        "completed",
        1250,
        "completed",
    )
    assert (failed.outcome, failed.job.id, failed.job.state) == (
        "failed",
        parked.job(ASYNC),
        "failed",
    )
    assert pg_call(parked.urls[1], on_pg(callback, PAID, "ignore")) is None


@pytest.mark.parametrize("form", FORMS)
def test_a_resolve_through_every_driver_and_form(parked: Parked, form: str) -> None:
    """On one twin, through psycopg2, pg8000 or a Session: the answer and the job read back
    as through psycopg 3."""
    n = FORMS[form]
    driver = "psycopg" if form == "session" else form
    url = sa.make_url(parked.urls[1]).set(drivername=f"postgresql+{driver}")
    engine = sa.create_engine(url)
    callback = waiting_on(parked, 1, n)
    try:
        if form == "session":
            with Session(engine) as session, session.begin():
                got = awa_sa.resolve_callback(session, callback, PAID)
        else:
            with engine.begin() as conn:
                got = awa_sa.resolve_callback(conn, callback, PAID)
    finally:
        engine.dispose()
    assert got is not None
    assert got.job is not None
    assert (got.outcome, got.job.id, got.job.state) == ("completed", parked.job(n), "completed")
    assert got.payload == {"n": 2, "order": "A-1", "paid": 1250}
    assert parked.callback_id(1, n) is None
