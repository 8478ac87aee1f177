"""Every bind form and every supported driver enqueues the rows psycopg 3's Engine does.

On twin clones in the same phase, psycopg 3's Engine form enqueues on one (once per phase), the
form and driver under test on the other; the tables must then hold the same rows, and a
duplicate must raise ``DuplicateJob`` naming the holder and leave a caller's transaction usable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from conftest import Cluster, cloned
from enqueuing import JOBS, snapshot
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import awa_sa
import awa_sa.asyncio
from awa_sa.enqueue.new_jobs import Options
from awa_sa.testing.databases import Databases
from awa_sa.testing.server import EmbeddedPostgres

NEW_JOBS = [awa_sa.NewJob(args, **options) for args, options in JOBS]
ARGS = [{"n": n, "to": f"u{n}@example.com"} for n in range(3)]
SHARED: Options = {"kind": "bulk", "priority": 3, "tags": ["t"], "metadata": {"m": 1}}
"""A list of args under one set of keywords: the batch shape that binds its values once."""
SYNC = [
    ("psycopg", "engine"),
    ("psycopg", "session"),
    ("psycopg2", "connection"),
    ("pg8000", "connection"),
]
ASYNC = [("asyncpg", "engine"), ("asyncpg", "connection"), ("psycopg", "session")]


@pytest.fixture(scope="module")
def in_phase(
    pg: EmbeddedPostgres, awa_databases: Databases, real_template: str
) -> Iterator[dict[str, str]]:
    """The ``awa migrate`` database in each phase, a template for the twins: the published CLI
    moves one database once (three commands), not both twins of every test (issue 39)."""
    with cloned(pg, awa_databases, real_template) as url:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        Cluster("real", pg, url, engine).set_phase("active", "awa_qs")
        engine.dispose()  # a database is cloned only without open connections
        yield {"canonical": real_template, "active": sa.make_url(url).database or ""}


def _baseline(engine: sa.Engine) -> dict[str, list[str]]:
    """psycopg 3's Engine form: the batch, then a duplicate refused; the rows it left."""
    awa_sa.enqueue_many(engine, NEW_JOBS)
    awa_sa.enqueue_many(engine, ARGS, **SHARED)
    args, options = JOBS[8]  # a unique job of the batch
    with pytest.raises(awa_sa.DuplicateJob):
        awa_sa.enqueue(engine, args, **options)
    return snapshot(engine)


@pytest.fixture(scope="module")
def baselines(
    pg: EmbeddedPostgres, awa_databases: Databases, in_phase: dict[str, str]
) -> Callable[[str], dict[str, list[str]]]:
    """psycopg 3's rows in each phase, made once on a clone of its own: they depend on nothing
    a test varies (the snapshot masks timestamps, and ``by_period`` hashes the number given,
    not the current period), so a twin and its enqueue beside every test bought nothing."""
    made: dict[str, dict[str, list[str]]] = {}

    def rows(phase: str) -> dict[str, list[str]]:
        if phase not in made:
            with cloned(pg, awa_databases, in_phase[phase]) as url:
                engine = sa.create_engine(url, poolclass=sa.NullPool)
                try:
                    made[phase] = _baseline(engine)
                finally:
                    engine.dispose()
        return made[phase]

    return rows


@dataclass
class Twin:
    """The clone the form and driver under test enqueue on, and psycopg 3's rows in its phase."""

    url: str
    engine: sa.Engine
    expected: dict[str, list[str]]


@pytest.fixture(params=["canonical", "active"])
def twin(
    request: pytest.FixtureRequest,
    clone_database: Callable[[str], str],
    in_phase: dict[str, str],
    baselines: Callable[[str], dict[str, list[str]]],
) -> Iterator[Twin]:
    expected = baselines(request.param)
    url = clone_database(in_phase[request.param])
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        yield Twin(url, engine, expected)
    finally:
        engine.dispose()


def _url(twin: Twin, driver: str) -> sa.URL:
    return sa.make_url(twin.url).set(drivername=f"postgresql+{driver}")


@pytest.mark.parametrize(("driver", "form"), SYNC)
def test_sync_forms_and_drivers(twin: Twin, driver: str, form: str) -> None:
    engine = sa.create_engine(_url(twin, driver), poolclass=sa.NullPool)
    args, options = JOBS[8]
    try:
        if form == "engine":
            rows = awa_sa.enqueue_many(engine, NEW_JOBS)
            shared = awa_sa.enqueue_many(engine, ARGS, **SHARED)
            with pytest.raises(awa_sa.DuplicateJob) as raised:
                awa_sa.enqueue(engine, args, **options)
        elif form == "session":
            with Session(engine) as session:
                rows = awa_sa.enqueue_many(session, NEW_JOBS)
                shared = awa_sa.enqueue_many(session, ARGS, **SHARED)
                with pytest.raises(awa_sa.DuplicateJob) as raised:
                    awa_sa.enqueue(session, args, **options)
                session.commit()
        else:
            with engine.connect() as conn:
                rows = awa_sa.enqueue_many(conn, NEW_JOBS)
                shared = awa_sa.enqueue_many(conn, ARGS, **SHARED)
                with pytest.raises(awa_sa.DuplicateJob) as raised:
                    awa_sa.enqueue(conn, args, **options)
                conn.commit()
    finally:
        engine.dispose()
    assert raised.value.existing_id == rows[8].id
    assert [r.args for r in rows] == [args for args, _ in JOBS]
    assert [(r.args, r.tags) for r in shared] == [(a, ("t",)) for a in ARGS]
    assert snapshot(twin.engine) == twin.expected


@pytest.mark.parametrize(("driver", "form"), ASYNC)
def test_async_forms_and_drivers(twin: Twin, driver: str, form: str) -> None:
    args, options = JOBS[8]

    async def enqueue() -> tuple[
        list[awa_sa.EnqueuedJob], list[awa_sa.EnqueuedJob], awa_sa.DuplicateJob
    ]:
        engine = create_async_engine(_url(twin, driver), poolclass=sa.NullPool)
        try:
            if form == "engine":
                rows = await awa_sa.asyncio.enqueue_many(engine, NEW_JOBS)
                shared = await awa_sa.asyncio.enqueue_many(engine, ARGS, **SHARED)
                with pytest.raises(awa_sa.DuplicateJob) as raised:
                    await awa_sa.asyncio.enqueue(engine, args, **options)
            elif form == "session":
                async with AsyncSession(engine) as session:
                    rows = await awa_sa.asyncio.enqueue_many(session, NEW_JOBS)
                    shared = await awa_sa.asyncio.enqueue_many(session, ARGS, **SHARED)
                    with pytest.raises(awa_sa.DuplicateJob) as raised:
                        await awa_sa.asyncio.enqueue(session, args, **options)
                    await session.commit()
            else:
                async with engine.connect() as conn:
                    rows = await awa_sa.asyncio.enqueue_many(conn, NEW_JOBS)
                    shared = await awa_sa.asyncio.enqueue_many(conn, ARGS, **SHARED)
                    with pytest.raises(awa_sa.DuplicateJob) as raised:
                        await awa_sa.asyncio.enqueue(conn, args, **options)
                    await conn.commit()
            return rows, shared, raised.value
        finally:
            await engine.dispose()

    rows, shared, duplicate = asyncio.run(enqueue())
    assert duplicate.existing_id == rows[8].id
    assert [(r.args, r.tags) for r in shared] == [(a, ("t",)) for a in ARGS]
    assert snapshot(twin.engine) == twin.expected
