"""ORM sessions as binds: ``Session`` and ``AsyncSession`` join the session's transaction.

Most SQLAlchemy services hold a session, not a Connection. A session bind is the Connection form
on ``session.connection()``: the reschedule commits or rolls back with the session's own work
(pending ORM objects included), never by itself, and inside ``begin_nested()`` it is undone with
the savepoint. Every supported driver, both routings (queue storage writes under a savepoint of
its own, nested in the session's).
"""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from jobs import insert_job, scalar
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import awa_sa.asyncio as awa_async
import awa_sa_schema
from awa_sa import (
    Attempt,
    Migrated,
    Outcome,
    Rescheduled,
    Snooze,
    reschedule_canonical_attempt,
    reschedule_canonical_attempts,
)

SYNC_DRIVERS = ("psycopg", "psycopg2", "pg8000")
ASYNC_DRIVERS = ("psycopg", "asyncpg")
ROUTINGS = [("canonical", Rescheduled), ("mixed_transition", Migrated)]


class Base(DeclarativeBase):
    pass


class Audit(Base):
    """The service's own ORM table, written in the same transaction as the reschedule."""

    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int]


@pytest.fixture(params=[routing for routing, _ in ROUTINGS])
def database(request: pytest.FixtureRequest, engine: sa.Engine) -> sa.Engine:
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        awa_sa_schema.set_phase(conn, request.param, "awa_qs")
    return engine


def expected(engine: sa.Engine) -> type[Outcome]:
    with engine.connect() as conn:
        phase = scalar(conn, "SELECT state FROM awa.storage_transition_state")
    return Migrated if phase == "mixed_transition" else Rescheduled


def running(engine: sa.Engine) -> int:
    with engine.begin() as conn:
        return insert_job(conn)


def state(engine: sa.Engine, job: int) -> str | None:
    """The job's canonical state seen from another connection (None: it left jobs_hot)."""
    with engine.connect() as conn:
        found = scalar(conn, "SELECT state::text FROM awa.jobs_hot WHERE id = :i", i=job)
        return None if found is None else str(found)


def audited(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(Audit.job_id).order_by(Audit.id)).scalars())


def url(engine: sa.Engine, driver: str) -> sa.URL:
    return engine.url.set(drivername=f"postgresql+{driver}")


@pytest.mark.parametrize("driver", SYNC_DRIVERS)
def test_a_session_joins_its_transaction_with_pending_orm_changes(
    database: sa.Engine, driver: str
) -> None:
    outcome_type = expected(database)
    engine = sa.create_engine(url(database, driver))
    try:
        first, second = running(database), running(database)
        with Session(engine) as session:
            session.add(Audit(job_id=first))  # pending: not flushed before the call
            outcome = reschedule_canonical_attempt(session, first, 1, Snooze(60))
            assert isinstance(outcome, outcome_type)
            assert state(database, first) == "running"  # never committed by the call
            session.rollback()
        assert (state(database, first), audited(database)) == ("running", [])
        with Session(engine) as session:
            session.add(Audit(job_id=first))
            assert isinstance(
                reschedule_canonical_attempt(session, first, 1, Snooze(60)), outcome_type
            )
            session.commit()
        assert (state(database, first), audited(database)) == (None, [first])
        with Session(engine) as session, session.begin():
            with session.begin_nested() as savepoint:
                outcomes = reschedule_canonical_attempts(session, [Attempt(second, 1, Snooze(9))])
                assert [type(o) for o in outcomes] == [outcome_type]
                savepoint.rollback()
            assert state(database, second) == "running"
            with session.begin_nested():
                assert isinstance(
                    reschedule_canonical_attempt(session, second, 1, Snooze(9)), outcome_type
                )
                session.add(Audit(job_id=second))
        assert (state(database, second), audited(database)) == (None, [first, second])
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
def test_an_async_session_joins_its_transaction_with_pending_orm_changes(
    database: sa.Engine, driver: str
) -> None:
    outcome_type = expected(database)
    first, second = running(database), running(database)

    async def scenario() -> None:
        engine = create_async_engine(url(database, driver))
        try:
            async with AsyncSession(engine) as session:
                session.add(Audit(job_id=first))
                outcome = await awa_async.reschedule_canonical_attempt(
                    session, first, 1, Snooze(60)
                )
                assert isinstance(outcome, outcome_type)
                assert state(database, first) == "running"
                await session.rollback()
            assert (state(database, first), audited(database)) == ("running", [])
            async with AsyncSession(engine) as session:
                session.add(Audit(job_id=first))
                outcome = await awa_async.reschedule_canonical_attempt(
                    session, first, 1, Snooze(60)
                )
                assert isinstance(outcome, outcome_type)
                await session.commit()
            assert (state(database, first), audited(database)) == (None, [first])
            async with AsyncSession(engine) as session, session.begin():
                async with session.begin_nested() as savepoint:
                    outcomes = await awa_async.reschedule_canonical_attempts(
                        session, [Attempt(second, 1, Snooze(9))]
                    )
                    assert [type(o) for o in outcomes] == [outcome_type]
                    await savepoint.rollback()
                assert state(database, second) == "running"
                async with session.begin_nested():
                    outcome = await awa_async.reschedule_canonical_attempt(
                        session, second, 1, Snooze(9)
                    )
                    assert isinstance(outcome, outcome_type)
                    session.add(Audit(job_id=second))
            assert (state(database, second), audited(database)) == (None, [first, second])
        finally:
            await engine.dispose()

    asyncio.run(scenario())
