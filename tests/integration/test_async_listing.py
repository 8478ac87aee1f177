"""``awa_sa.asyncio.attempt_of`` and ``running_attempts``: the sync answers, on every async form.

Both planes are seeded by the kit (a canonical claim from before the flip, a queue-storage
receipt after it), then each async form, on each async driver, is compared with the sync call
on the same rows: the same attempts, the same errors. The comparisons that only read share one
seeded clone for the module (:func:`shared`); a test that settles has a clone of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import cloned
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import AttemptNotFound, ValidationError
from awa_sa.testing import job_of, queue_storage_attempt, running_attempt, set_phase
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

FORMS = ("engine", "connection", "session")


@pytest.fixture(params=["psycopg", "asyncpg"])
async def async_bind_engine(
    request: pytest.FixtureRequest, db_url: str
) -> AsyncIterator[AsyncEngine]:
    url = sa.make_url(db_url).set(drivername=f"postgresql+{request.param}")
    engine = create_async_engine(url, poolclass=sa.NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


@dataclass(frozen=True)
class Shared:
    """One seeded clone that the tests which only read share, through pooled connections: a
    new backend loads the catalog of the planes' hundreds of partitions before its first
    listing, and a clone, its seed and a backend per call cost more than the comparisons
    (issue 39)."""

    url: str
    engine: sa.Engine
    canonical: Any
    receipt: Any


@pytest.fixture(scope="module")
def shared(
    pg: EmbeddedPostgres, awa_databases: Databases, fixture_template: str
) -> Iterator[Shared]:
    with cloned(pg, awa_databases, fixture_template) as url:
        engine = sa.create_engine(url, pool_size=1)
        try:
            yield Shared(url, engine, *seeded(engine))
        finally:
            engine.dispose()


@pytest.fixture(params=["psycopg", "asyncpg"])
async def shared_async(
    request: pytest.FixtureRequest, shared: Shared
) -> AsyncIterator[AsyncEngine]:
    url = sa.make_url(shared.url).set(drivername=f"postgresql+{request.param}")
    engine = create_async_engine(url, pool_size=1)
    try:
        yield engine
    finally:
        await engine.dispose()


def seeded(engine: sa.Engine) -> tuple[Any, Any]:
    """A canonical claim from before the flip and a queue-storage receipt after it."""
    with engine.begin() as conn:
        job_id, _ = running_attempt(conn, kind="send_email", queue="mail")
        set_phase(conn, "mixed_transition")
        receipt = queue_storage_attempt(conn, kind="send_invoice", queue="billing")
    [canonical] = awa_sa.running_attempts(engine, job_id=job_id, kind="send_email")
    return canonical, receipt


def still(attempt: awa_sa.RunningAttempt) -> awa_sa.RunningAttempt:
    """*attempt* without ``running_for``, which grows between two reads."""
    return replace(attempt, running_for=timedelta(0))


async def on_form(engine: AsyncEngine, form: str, call: Callable[[Any], Any]) -> Any:
    """``call(bind)`` with *engine* as that form: the engine, a connection, or a session."""
    if form == "engine":
        return await call(engine)
    if form == "connection":
        conn: AsyncConnection
        async with engine.connect() as conn:
            return await call(conn)
    async with AsyncSession(engine) as session:
        return await call(session)


@pytest.mark.parametrize("form", FORMS)
async def test_attempt_of_finds_the_sync_answer_in_either_plane(
    shared: Shared, shared_async: AsyncEngine, form: str
) -> None:
    for mine in (shared.canonical, shared.receipt):
        job = job_of(mine)
        found = await on_form(shared_async, form, partial(awa_async.attempt_of, job=job))
        assert still(found) == still(awa_sa.attempt_of(shared.engine, job))
        assert (found.storage, found.job_id) == (mine.storage, mine.job_id)


@pytest.mark.parametrize("form", FORMS)
async def test_running_attempts_lists_what_the_sync_call_lists(
    shared: Shared, shared_async: AsyncEngine, form: str
) -> None:
    engine, receipt = shared.engine, shared.receipt
    for filters in (
        {},
        {"queue": "billing"},
        {"kind": "send_email", "running_for": timedelta(0)},
        {"job_id": receipt.job_id, "attempt": 1},
        {"limit": 1},
    ):
        listed = await on_form(shared_async, form, partial(awa_async.running_attempts, **filters))
        expected = awa_sa.running_attempts(engine, **filters)
        assert [(a.storage, a.job_id) for a in listed] == [(a.storage, a.job_id) for a in expected]
        assert [a.receipt_id for a in listed] == [a.receipt_id for a in expected]
    everything = await on_form(shared_async, form, awa_async.running_attempts)
    assert {a.storage for a in everything} == {awa_sa.CANONICAL, receipt.storage}


@pytest.mark.parametrize("form", FORMS)
async def test_a_settled_attempt_is_not_found_as_in_sync(
    engine: sa.Engine, async_bind_engine: AsyncEngine, form: str
) -> None:
    _, receipt = seeded(engine)
    job = job_of(receipt)
    awa_sa.settle(engine, receipt, awa_sa.Complete())
    with pytest.raises(AttemptNotFound) as sync_error:
        awa_sa.attempt_of(engine, job)
    with pytest.raises(AttemptNotFound) as async_error:
        await on_form(async_bind_engine, form, lambda b: awa_async.attempt_of(b, job))
    assert str(async_error.value) == str(sync_error.value)


async def test_a_sync_bind_is_refused_before_any_statement(shared: Shared) -> None:
    engine = shared.engine
    with pytest.raises(ValidationError, match="AsyncEngine, AsyncConnection or AsyncSession"):
        await awa_async.running_attempts(engine)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="AsyncEngine, AsyncConnection or AsyncSession"):
        await awa_async.attempt_of(engine, object())  # type: ignore[arg-type]


async def test_a_handler_writes_its_row_and_settles_in_one_transaction(
    engine: sa.Engine, async_bind_engine: AsyncEngine
) -> None:
    """The README's recipe: find the attempt, write the row, settle, one transaction."""
    _, receipt = seeded(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE invoices (job_id bigint PRIMARY KEY)")
    job = job_of(receipt)
    async with async_bind_engine.begin() as conn:
        mine = await awa_async.attempt_of(conn, job)
        await conn.execute(sa.text("INSERT INTO invoices VALUES (:id)"), {"id": job.id})
        outcome = await awa_async.settle(conn, mine, awa_sa.Complete())
    assert outcome == awa_sa.Completed(job.id)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT job_id FROM invoices").scalars().all()
    assert rows == [job.id]
    assert awa_sa.running_attempts(engine, kind="send_invoice") == []
