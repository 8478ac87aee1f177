"""One attempt, one job: where the planes' ``(job_id, run_lease)`` collide, no call moves the
wrong one (docs/contract.md#bare-pair).

During a storage transition a canonical attempt A (``awa.jobs_hot``) and a queue-storage
attempt B (a receipt of ``awa_qs``) can share ``(job_id, run_lease)``: both id sequences and
both leases start at 1, and here they collide with no ``setval``. ``settle`` with A's
``RunningAttempt`` moves A alone; with B's it settles B alone, in ``awa_qs``. A canonical call
given the bare pair is refused, since the pair may mean B, and a pair only B holds is never
answered ``Stale``. Every refusal leaves every row as it was.

The observers hold one pooled connection: a new backend loads the catalog entries of the
planes' hundreds of partitions before its first read, and a backend per read cost each form
and driver more than its calls (issue 39).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Cluster, database_url
from jobs import insert_job, snapshot_of
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio as awa_async
from awa_sa import (
    CANONICAL,
    Attempt,
    Migrated,
    QueueStorageAttempt,
    Rescheduled,
    RunningAttempt,
    Snooze,
    running_attempts,
)
from awa_sa.testing import queue_storage_attempt

QS = "awa_qs"


def _colliding(cluster: Cluster) -> tuple[RunningAttempt, RunningAttempt, RunningAttempt]:
    """A canonical attempt A and a queue-storage attempt B under one pair, and a
    queue-storage attempt C whose pair no canonical row has."""
    cluster.set_phase("mixed_transition", QS)
    with cluster.engine.begin() as conn:
        insert_job(conn, kind="send_email", queue="mail")
        qs_b = queue_storage_attempt(conn, schema=QS, kind="send_email", queue="mail")
        qs_c = queue_storage_attempt(conn, schema=QS, kind="send_email", queue="mail")
    (a,) = [a for a in running_attempts(cluster.engine) if a.storage == CANONICAL]
    assert (a.job_id, a.run_lease) == (qs_b.job_id, qs_b.run_lease), "the planes must collide"
    return a, qs_b, qs_c


def test_a_bare_pair_both_planes_hold_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    a, b, c = _colliding(cluster)
    before = snapshot_of(cluster.engine)
    with pytest.raises(QueueStorageAttempt) as both:
        awa_sa.reschedule_canonical_attempt(cluster.engine, a.job_id, a.run_lease, Snooze(60))
    assert (both.value.job_id, both.value.schema, both.value.canonical_too) == (a.job_id, QS, True)
    with cluster.engine.begin() as conn, pytest.raises(QueueStorageAttempt):
        awa_sa.reschedule_canonical_attempt(conn, b.job_id, b.run_lease, Snooze(60))
    batch = [Attempt(c.job_id + 100, 1, Snooze(1)), Attempt(b.job_id, b.run_lease, Snooze(1))]
    with pytest.raises(QueueStorageAttempt):
        awa_sa.reschedule_canonical_attempts(cluster.engine, batch)
    # A pair that only a queue-storage claim holds is that claim's, not a settled one's.
    with pytest.raises(QueueStorageAttempt) as only:
        awa_sa.reschedule_canonical_attempt(cluster.engine, c.job_id, c.run_lease, Snooze(60))
    assert only.value.canonical_too is False
    assert snapshot_of(cluster.engine) == before


def test_settle_moves_the_canonical_attempt_alone(cluster: Cluster) -> None:
    a, b, c = _colliding(cluster)
    outcome = awa_sa.settle(cluster.engine, a, Snooze(60))
    assert isinstance(outcome, Migrated)
    running = running_attempts(cluster.engine)
    assert [x.storage for x in running] == [QS, QS]
    assert {(x.job_id, x.run_lease, x.receipt_id) for x in running} == {
        (b.job_id, b.run_lease, b.receipt_id),
        (c.job_id, c.run_lease, c.receipt_id),
    }
    with cluster.engine.connect() as conn:
        moved = conn.execute(
            sa.text(f"SELECT state::text, attempt FROM {QS}.deferred_jobs WHERE job_id = :j"),
            {"j": outcome.job_id},
        ).one()
    assert tuple(moved) == ("scheduled", a.attempt - 1)


def test_settle_settles_the_queue_storage_attempt_alone(cluster: Cluster) -> None:
    a, b, c = _colliding(cluster)
    canonical_before = _canonical_rows(cluster.engine)
    outcome = awa_sa.settle(cluster.engine, b, Snooze(60))
    assert isinstance(outcome, Rescheduled)
    assert outcome.job_id == b.job_id
    assert _canonical_rows(cluster.engine) == canonical_before
    running = running_attempts(cluster.engine)
    assert {(x.storage, x.job_id, x.receipt_id) for x in running} == {
        (CANONICAL, a.job_id, None),
        (QS, c.job_id, c.receipt_id),
    }
    with cluster.engine.connect() as conn:
        moved = conn.execute(
            sa.text(f"SELECT state::text, attempt FROM {QS}.deferred_jobs WHERE job_id = :j"),
            {"j": b.job_id},
        ).one()
    assert tuple(moved) == ("scheduled", b.attempt - 1)


def _canonical_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return [
            tuple(row)
            for table in ("awa.jobs_hot", "awa.scheduled_jobs", "awa.job_unique_claims")
            for row in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1"))
        ]


@contextmanager
def _sync_form(form: str, engine: sa.Engine) -> Iterator[Any]:
    if form == "engine":
        yield engine
    elif form == "connection":
        with engine.begin() as conn:
            yield conn
    else:
        with Session(engine) as session, session.begin():
            yield session


@pytest.mark.parametrize("form", ["engine", "connection", "session"])
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2", "pg8000"])
def test_every_sync_form_and_driver(
    pg: Any, clone_database: Callable[[str], str], fixture_template: str, form: str, driver: str
) -> None:
    url = clone_database(fixture_template)
    observer = sa.create_engine(url, pool_size=1)
    engine = sa.create_engine(database_url(pg, sa.make_url(url).database or "", driver))
    try:
        a, b, c = _colliding(Cluster("fixture", pg, url, observer))
        before = snapshot_of(observer)
        for attempt in (b, c):
            with _sync_form(form, engine) as bind, pytest.raises(QueueStorageAttempt):
                awa_sa.reschedule_canonical_attempt(bind, attempt.job_id, 1, Snooze(5))
        assert snapshot_of(observer) == before
        with _sync_form(form, engine) as bind:
            assert isinstance(awa_sa.settle(bind, b, Snooze(5)), Rescheduled)
        with _sync_form(form, engine) as bind:
            assert isinstance(awa_sa.settle(bind, a, Snooze(5)), Migrated)
        assert [x.receipt_id for x in running_attempts(observer)] == [c.receipt_id]
    finally:
        engine.dispose()
        observer.dispose()


@pytest.mark.parametrize("form", ["engine", "connection", "session"])
@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_every_async_form_and_driver(
    pg: Any, clone_database: Callable[[str], str], fixture_template: str, form: str, driver: str
) -> None:
    url = clone_database(fixture_template)
    observer = sa.create_engine(url, pool_size=1)
    a, b, c = _colliding(Cluster("fixture", pg, url, observer))
    before = snapshot_of(observer)

    async def walk() -> None:
        engine = create_async_engine(database_url(pg, sa.make_url(url).database or "", driver))
        try:

            async def call(run: Callable[[Any], Any]) -> Any:
                if form == "engine":
                    return await run(engine)
                if form == "connection":
                    async with engine.begin() as conn:
                        return await run(conn)
                async with AsyncSession(engine) as session, session.begin():
                    return await run(session)

            for attempt in (b, c):

                def bare(bind: Any, x: RunningAttempt = attempt) -> Any:
                    return awa_async.reschedule_canonical_attempt(bind, x.job_id, 1, Snooze(5))

                with pytest.raises(QueueStorageAttempt):
                    await call(bare)
            assert snapshot_of(observer) == before
            settled = await call(lambda bind: awa_async.settle(bind, b, Snooze(5)))
            assert isinstance(settled, Rescheduled)
            moved = await call(lambda bind: awa_async.settle(bind, a, Snooze(5)))
            assert isinstance(moved, Migrated)
        finally:
            await engine.dispose()

    try:
        asyncio.run(walk())
        assert [x.receipt_id for x in running_attempts(observer)] == [c.receipt_id]
    finally:
        observer.dispose()
