"""awa-sa behind a real PgBouncer (Debian's, installed by ``./dev``) in transaction pooling mode.

Transaction pooling hands each transaction whichever server connection is free, so a driver
that keeps prepared statements on "its" connection finds them missing (26000) or another
client's under the same name (42P05). awa-sa cannot choose how the driver executes: SQLAlchemy
passes no per-statement switch through to psycopg 3 or asyncpg. The settings in
:data:`RECOMMENDED` (docs/deploying.md) make every driver safe, and the tests prove it:

* the driver walk of ``test_drivers.py`` (every outcome, the batch, errors, both routings)
  through the pooler gives the outcomes, statements and rows psycopg 3 gives without it;
* two processes of four concurrent callers each, over two server connections, end every job
  exactly once;
* psycopg 3's and asyncpg's defaults fail there, so the advice stays true;
* timeouts go in the caller's transaction (``SET LOCAL``): PgBouncer refuses them as startup
  options, which every driver reports alike (08P01).
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.managers import SyncManager
from multiprocessing.pool import Pool as PoolType
from typing import Any

import pytest
import sqlalchemy as sa
from calling import DRIVERS, SNOOZE, callers, driver_url, is_async, refusal
from conftest import Cluster, cloned
from jobs import insert_job
from racing import fingerprint, held
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine
from test_drivers import Face, Walk, _remember_pid, seeded_database, walk

from awa_sa import Attempt, DatabaseError, Rescheduled
from awa_sa.testing.databases import Databases
from awa_sa.testing.pooler import PgBouncer, find_pgbouncer, pgbouncer
from awa_sa.testing.server import EmbeddedPostgres

pytestmark = [
    pytest.mark.slow,  # a PgBouncer per test, in front of the suite's server
    pytest.mark.skipif(
        find_pgbouncer() is None, reason="pgbouncer is not installed (./dev installs it)"
    ),
]

RECOMMENDED: dict[str, dict[str, Any]] = {
    "psycopg": {"connect_args": {"prepare_threshold": None}},
    "psycopg-async": {"connect_args": {"prepare_threshold": None}},
    "psycopg2": {},
    "pg8000": {},
    "asyncpg": {"connect_args": {"statement_cache_size": 0}},
}
"""Engine options per driver under transaction pooling (docs/deploying.md#poolers)."""


class PooledFace(Face):
    """:class:`test_drivers.Face` with engine options (the driver settings under test)."""

    def __init__(self, driver: str, url: str, options: dict[str, Any]) -> None:
        self.driver = driver
        self.is_async = is_async(driver)
        target = driver_url(url, driver)
        self.async_engine = None
        if self.is_async:
            import asyncio  # noqa: PLC0415 -- as Face does

            self._loop = asyncio.Runner()
            self.async_engine = create_async_engine(target, **options)
            self.engine = self.async_engine.sync_engine
        else:
            self.engine = sa.create_engine(target, **options)
        event.listen(self.engine, "connect", _remember_pid)


@pytest.fixture(scope="module")
def bouncer(pg: EmbeddedPostgres) -> Iterator[PgBouncer]:
    with pgbouncer(pg, pool_size=2) as running:
        yield running


@pytest.fixture(scope="module")
def seeded_source(pg: EmbeddedPostgres, fixture_template: str) -> Iterator[tuple[str, Any]]:
    """The walk's seeded database (Alembic fixture), a source for clones."""
    with seeded_database(pg, fixture_template, f"pooled_{uuid.uuid4().hex[:12]}") as source:
        yield source


def _walk_on_clone(
    pg: EmbeddedPostgres, databases: Databases, source: tuple[str, Any], make_face: Any
) -> Walk:
    """The walk on a clone the kit makes (its files copied, on its pooled maintenance
    connection: a third of a janitor's CPU)."""
    with cloned(pg, databases, source[0]) as url:
        name = sa.make_url(url).database or ""
        observer = sa.create_engine(url, poolclass=sa.NullPool)
        face = make_face(name)
        try:
            return walk(face, Cluster("fixture", pg, url, observer), source[1])
        finally:
            face.dispose()
            observer.dispose()


WalkOnClone = Callable[[Callable[[str], Face]], Walk]


@pytest.fixture(scope="module")
def walk_on_clone(
    pg: EmbeddedPostgres, awa_databases: Databases, seeded_source: tuple[str, Any]
) -> WalkOnClone:
    """The walk on a new clone of the seeded database, by the face made for the clone's name."""
    return lambda make_face: _walk_on_clone(pg, awa_databases, seeded_source, make_face)


@pytest.fixture(scope="module")
def direct_walk(pg: EmbeddedPostgres, walk_on_clone: WalkOnClone) -> Walk:
    """psycopg 3, no pooler: the outcomes and rows every pooled walk must reproduce."""
    return walk_on_clone(lambda name: Face("psycopg", pg.database_url(name)))


@pytest.mark.parametrize("driver", DRIVERS)
def test_the_walk_through_pgbouncer_matches_a_direct_connection(
    driver: str, bouncer: PgBouncer, walk_on_clone: WalkOnClone, direct_walk: Walk
) -> None:
    def pooled(name: str) -> Face:
        return PooledFace(driver, bouncer.database_url(name), RECOMMENDED[driver])

    got = walk_on_clone(pooled)
    assert got.results == direct_walk.results
    names = {r[0] if isinstance(r, tuple) else r.split("(")[0] for r in got.results}
    assert {"Rescheduled", "Migrated", "CancelledDuplicate", "Stale", "UniqueConflict"} <= names
    assert got.sent == direct_walk.sent
    for table, rows in direct_walk.tables.items():
        assert got.tables[table] == rows, table


@pytest.fixture(scope="module")
def two_processes() -> Iterator[tuple[SyncManager, PoolType]]:
    """Two worker processes and a manager for their barrier, shared by the drivers' runs: each
    spawned process imports SQLAlchemy, every driver and awa-sa again, half a second of CPU
    (issue 39). A run's two tasks still land on both workers: the first waits at the barrier,
    so only the other worker is free to take the second."""
    spawn = multiprocessing.get_context("spawn")  # no fork of a process with live connections
    with spawn.Manager() as manager, spawn.Pool(2) as pool:
        yield manager, pool


@pytest.mark.parametrize("driver", DRIVERS)
def test_two_processes_of_callers_end_each_job_once(
    driver: str,
    bouncer: PgBouncer,
    two_processes: tuple[SyncManager, PoolType],
    db_url: str,
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        ids = [insert_job(conn) for _ in range(80)]
    url = bouncer.database_url(sa.make_url(db_url).database or "")
    options = RECOMMENDED[driver]
    manager, pool = two_processes
    ready = manager.Barrier(2, timeout=60)
    running = [
        pool.apply_async(callers, (driver, url, ids[i::2], 4, options), {"ready": ready})
        for i in range(2)
    ]
    errors = [each.get() for each in running]
    assert errors == [[], []]
    with engine.connect() as conn:
        moved = conn.execute(
            sa.text("SELECT id, count(*) FROM awa.scheduled_jobs WHERE id = ANY(:i) GROUP BY id"),
            {"i": ids},
        ).all()
        running = conn.scalar(
            sa.text("SELECT count(*) FROM awa.jobs_hot WHERE id = ANY(:i)"), {"i": ids}
        )
    assert sorted(moved) == [(i, 1) for i in ids]
    assert running == 0


def _alternating(driver: str, url: str, options: dict[str, Any], ids: list[int]) -> list[str]:
    """Two callers, each with its own client connection, taking turns: one call at a time."""
    faces = [PooledFace(driver, url, {**options, "pool_size": 1}) for _ in range(2)]
    errors = []
    try:
        for index, job_id in enumerate(ids):
            try:
                faces[index % 2].call(job_id, 1, SNOOZE)
            except Exception as exc:
                errors.append(str(getattr(exc, "sqlstate", exc)))
    finally:
        for face in faces:
            face.dispose()
    return errors


def test_psycopg_defaults_fail_under_transaction_pooling(
    pg: EmbeddedPostgres, db_url: str, engine: sa.Engine
) -> None:
    """One server connection shared by two clients in turn: after five runs of a statement
    psycopg 3 prepares it as ``_pg3_0``, and the other client's ``_pg3_0`` is already there."""
    with engine.begin() as conn:
        ids = [insert_job(conn) for _ in range(40)]
    dbname = sa.make_url(db_url).database or ""
    with pgbouncer(pg, pool_size=1) as single:
        url = single.database_url(dbname)
        defaults = _alternating("psycopg", url, {}, ids[:20])
        recommended = _alternating("psycopg", url, RECOMMENDED["psycopg"], ids[20:])
    assert defaults
    assert set(defaults) <= {"42P05", "26000"}
    assert recommended == []


def test_asyncpg_defaults_fail_across_processes(
    pg: EmbeddedPostgres, db_url: str, engine: sa.Engine
) -> None:
    """asyncpg names its statements from a counter each process starts alike, and keeps them.

    Two processes in turn on one server connection: the second one's first prepare meets the
    first one's name (42P05). Run side by side on more server connections, they also miss their
    own (26000) or read rows with another statement's description (asyncpg's own
    AssertionError), but only when the interleaving happens to hit: in turn, it always does.
    """
    with engine.begin() as conn:
        ids = [insert_job(conn) for _ in range(16)]
    with pgbouncer(pg, pool_size=1) as single:
        url = single.database_url(sa.make_url(db_url).database or "")
        fresh = multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1)
        with fresh as pool:  # a process for each task, one after the other
            errors = pool.starmap(
                callers, [("asyncpg", url, ids[0::2], 4, {}), ("asyncpg", url, ids[1::2], 4, {})]
            )
    assert errors[0] == []
    assert any("[42P05]" in e for e in errors[1]), errors


STARTUP_TIMEOUT = {
    "psycopg": ({"options": "-c statement_timeout=1000"}, {}),
    "psycopg-async": ({"options": "-c statement_timeout=1000"}, {}),
    "psycopg2": ({"options": "-c statement_timeout=1000"}, {}),
    "pg8000": ({}, {"startup_params": {"options": "-c statement_timeout=1000"}}),
    "asyncpg": ({}, {"server_settings": {"statement_timeout": "1000"}}),
}
"""A statement timeout as each driver passes it at connection start-up."""


def test_pgbouncer_refuses_startup_timeouts_alike(bouncer: PgBouncer, db_url: str) -> None:
    url = sa.make_url(bouncer.database_url(sa.make_url(db_url).database or ""))
    seen = {}
    for driver, (query, connect_args) in STARTUP_TIMEOUT.items():
        options = {**RECOMMENDED[driver]}
        options["connect_args"] = {**options.get("connect_args", {}), **connect_args}
        exc = refusal(driver, url.update_query_dict(query), Attempt(1, 1, SNOOZE), **options)
        seen[driver] = (type(exc).__name__, getattr(exc, "sqlstate", None))
    assert seen == dict.fromkeys(DRIVERS, ("DatabaseError", "08P01"))


@pytest.mark.parametrize("driver", DRIVERS)
def test_set_local_timeouts_work_through_pgbouncer(
    driver: str, bouncer: PgBouncer, db_url: str, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        job = insert_job(conn)
    face = PooledFace(
        driver, bouncer.database_url(sa.make_url(db_url).database or ""), RECOMMENDED[driver]
    )
    try:
        before = fingerprint(engine)
        with held(engine) as transition:
            transition.execute(
                "SELECT 1 FROM awa.storage_transition_state WHERE singleton FOR UPDATE"
            )
            for setting, sqlstate in (("lock_timeout", "55P03"), ("statement_timeout", "57014")):
                with face.transaction() as tx:
                    tx.execute(f"SET LOCAL {setting} = '100ms'")
                    with pytest.raises(DatabaseError) as timed_out:
                        tx.call(job, 1, SNOOZE)
                    tx.rollback()
                assert timed_out.value.sqlstate == sqlstate
        assert fingerprint(engine) == before
        with face.transaction() as tx:  # gone with the transaction, on whichever server conn
            assert tx.scalar("SHOW statement_timeout") == "0"
            assert tx.scalar("SHOW lock_timeout") == "0"
            assert isinstance(tx.call(job, 1, SNOOZE), Rescheduled)
    finally:
        face.dispose()
